"""Gradient norm and clipping over parameters that mix plain tensors and DTensors on different meshes
(FSDP2 shards, TP shards, experts on the expert mesh), equal to the single-process norm.

torch.nn.utils.clip_grad_norm_ cannot stack norms of DTensors on different meshes, nor DTensors
with plain tensors; here each (mesh, placements) group's norm is reduced to a full (replicated)
value first; under pipeline parallelism the squares are then summed over the stages (torchtitan's clip_grad_norm_
does the same over its pp mesh). Every rank gets the same norm, so every rank scales alike.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def _grads(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in parameters if p.grad is not None]


def total_grad_norm(parameters: Iterable[torch.Tensor], pipeline_group=None) -> torch.Tensor:
    """The global L2 norm of the gradients (a plain scalar tensor, the same on every rank). pipeline_group: the
    ranks holding the other stages, whose parameters are not in `parameters`."""
    grads = _grads(parameters)
    if pipeline_group is not None:
        square = _local_norm(grads).float().pow(2) if grads else torch.zeros(())
        torch.distributed.all_reduce(square, group=pipeline_group)
        return square.sqrt()
    return _local_norm(grads)


def _local_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    if not any(isinstance(g, DTensor) for g in grads):
        return torch.nn.utils.get_total_norm(grads)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:  # the same order on every rank: the model's parameter order
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    squares = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm(members)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float().pow(2))
    return torch.stack(squares).sum().sqrt()


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, pipeline_group=None) -> torch.Tensor:
    """Scale the gradients so their global L2 norm is at most max_norm; returns the norm before."""
    parameters = list(parameters)
    grads = _grads(parameters)
    if pipeline_group is None and not any(isinstance(g, DTensor) for g in grads):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    norm = total_grad_norm(parameters, pipeline_group)
    coefficient = float((max_norm / (norm + 1e-6)).clamp(max=1.0))
    for g in grads:
        g.mul_(coefficient)
    return norm


def has_dtensor_parameters(module: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())
