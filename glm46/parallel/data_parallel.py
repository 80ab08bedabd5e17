"""Which ranks see different batches, asked of a Lightning strategy or trainer by duck typing: the mesh strategy
(glm46.lit.strategies.MeshParallelStrategy) names its data-parallel ranks, every other strategy's ranks all are."""

from __future__ import annotations

import torch


def data_parallel_group(strategy) -> torch.distributed.ProcessGroup | None:
    """The process group over which batches differ (None: all ranks)."""
    return getattr(strategy, "data_parallel_group", None)


def data_parallel_rank_and_size(trainer) -> tuple[int, int]:
    """(rank among the ranks that see different batches, their number): the global rank and world size,
    except under tensor parallelism, whose ranks share a batch."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
    if kwargs:
        return int(kwargs["rank"]), int(kwargs["num_replicas"])
    return trainer.global_rank, trainer.world_size


def data_parallel_size(trainer) -> int:
    """How many different batches one step sees (world size / tensor parallel)."""
    return data_parallel_rank_and_size(trainer)[1]
