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


def average_gradients_in_backward(parameters, strategy) -> None:
    """Average the gradients of weights a mesh layout leaves replicated outside the sharded model (a reward model's
    or a critic's head) over the data-parallel ranks as each backward accumulates them, as FSDP reduces the model's
    inside the backward (so that any hook or callback after it sees averaged gradients, and a step with gradient
    accumulation sums averages). Nothing under the other strategies: DDP and DeepSpeed wrap the whole
    LightningModule and average every gradient themselves."""
    group = data_parallel_group(strategy)
    if group is None:
        return

    def average(parameter: torch.Tensor) -> None:
        torch.distributed.all_reduce(parameter.grad, torch.distributed.ReduceOp.AVG, group=group)

    for parameter in parameters:
        parameter.register_post_accumulate_grad_hook(average)
