"""Lightning callbacks: loss-free expert balancing, throughput/MFU, batch-size warm-up, preemption."""

from .balancer import ExpertBalancer, max_violation
from .batch_warmup import BatchSizeWarmup
from .preemption import Preemption
from .throughput import Throughput

__all__ = ["BatchSizeWarmup", "ExpertBalancer", "Preemption", "Throughput", "max_violation"]
