"""Parallel layouts on torch.distributed: the sizes (`Layout`), the device mesh, and their application to the model
(TP, EP, CP, PP, activation checkpointing, FSDP2); the Lightning strategies that run them are glm46.lit.strategies."""

from .data_parallel import data_parallel_group, data_parallel_rank_and_size, data_parallel_size
from .layout import Layout

__all__ = ["Layout", "data_parallel_group", "data_parallel_rank_and_size", "data_parallel_size"]
