"""Lightning callbacks: loss-free expert balancing, throughput/MFU, batch-size warm-up."""

from .balancer import ExpertBalancer, max_violation
from .batch_warmup import BatchSizeWarmup
from .throughput import Throughput

__all__ = ["BatchSizeWarmup", "ExpertBalancer", "Throughput", "max_violation"]
