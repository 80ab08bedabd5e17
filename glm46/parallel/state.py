"""Full (unsharded) weights of a model sharded by FSDP2, TP, EP (DTensors) or DeepSpeed ZeRO-3, one
tensor at a time, for an export written by rank 0.

`full_state_items` is collective when the model is sharded: every rank must iterate it to the
end, in the same order (each DTensor is all-gathered, each ZeRO-3 parameter gathered by
DeepSpeed); memory holds one full tensor at a time beside the shards. On an unsharded model it
is `model.state_dict().items()` without any communication.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _zero3_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if hasattr(p, "ds_id")}


def state_shapes(model: torch.nn.Module) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Name -> (full shape, dtype) of every state-dict entry, in state-dict order, without communication."""
    zero3 = _zero3_parameters(model)
    shapes = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        shape = zero3[name].ds_shape if name in zero3 else tensor.shape  # DTensor.shape is the full shape
        shapes[name] = (torch.Size(shape), tensor.dtype)
    return shapes


def full_state_items(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every state-dict entry, in state-dict order; see the module docstring."""
    zero3 = _zero3_parameters(model)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([zero3[name]], modifier_rank=None):
                full = zero3[name].detach().clone()
        elif isinstance(tensor, DTensor):
            full = tensor.detach().full_tensor()
        else:
            full = tensor.detach()
        yield name, full


def is_writer() -> bool:
    """Whether this process writes shared files: global rank 0, or the only process."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
