"""Full (unsharded) weights of a model sharded by FSDP2, TP, EP (DTensors) or DeepSpeed ZeRO-3, one
tensor at a time, for an export written by rank 0.

`full_state_items` is collective when the model is sharded: every rank must iterate it to the
end, in the same order (each DTensor is all-gathered, each ZeRO-3 parameter gathered by
DeepSpeed); memory holds one full tensor at a time beside the shards. On an unsharded model it
is `model.state_dict().items()` without any communication.

`read_sharded_checkpoint` reads the weights back out of a sharded layout's checkpoint folder (DCP or
DeepSpeed) in one process, whatever layout wrote it: `init_from=<folder>`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

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


def read_sharded_checkpoint(path: str | Path, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The full weights of `model` (a GLM46ForCausalLM, unsharded) from a sharded Lightning checkpoint folder:
    a distributed checkpoint (DCP, MeshParallelStrategy: `*.distcp` + `meta.pt`) or a DeepSpeed ZeRO folder
    (`checkpoint/zero_pp_rank_*`); None for anything else. Read in one process, whatever layout wrote it;
    the LightningModule's `model.` prefix is removed."""
    path = Path(path)
    if not path.is_dir():
        return None
    if (path / ".metadata").is_file():
        import torch.distributed.checkpoint as dcp

        state = {"state_dict": {f"model.{k}": v.clone() for k, v in model.state_dict().items()}}
        single = not (dist.is_available() and dist.is_initialized())
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": reading in one process is the point
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=path, no_dist=single)  # only these keys
        return {k.removeprefix("model."): v for k, v in state["state_dict"].items()}
    if (path / "latest").is_file() or list(path.glob("*/zero_pp_rank_*_model_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(path)
        return {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    return None
