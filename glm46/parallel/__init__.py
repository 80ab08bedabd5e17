"""Parallel layouts with existing engines: Lightning's DDP, ModelParallelStrategy (FSDP2 x tensor x expert
parallel over one device mesh) and DeepSpeed ZeRO; see glm46.parallel.layout for the sizes."""

from .layout import Layout
from .strategies import (
    DeepSpeedStrategy,
    MeshParallelStrategy,
    build_strategy,
    data_parallel_group,
    data_parallel_rank_and_size,
    data_parallel_size,
)

__all__ = [
    "DeepSpeedStrategy",
    "Layout",
    "MeshParallelStrategy",
    "build_strategy",
    "data_parallel_group",
    "data_parallel_rank_and_size",
    "data_parallel_size",
]
