"""Lightning callbacks: loss-free expert balancing, throughput/MFU, batch-size warm-up, preemption, checkpoints,
progress, the Prometheus exporter, the hang watchdog, where each rank runs."""

from .balancer import ExpertBalancer, max_violation
from .batch_warmup import BatchSizeWarmup
from .model_checkpoint import ModelCheckpoint
from .placement import RankPlacement
from .preemption import Preemption
from .progress import Progress
from .prometheus import PrometheusExporter
from .throughput import Throughput
from .watchdog import HangWatchdog

__all__ = [
    "BatchSizeWarmup",
    "ExpertBalancer",
    "HangWatchdog",
    "ModelCheckpoint",
    "Preemption",
    "Progress",
    "PrometheusExporter",
    "RankPlacement",
    "Throughput",
    "max_violation",
]
