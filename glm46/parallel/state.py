"""Weights in and out of a model that may be sharded by FSDP2, TP, EP (DTensors) or DeepSpeed ZeRO-3.

Out: `gathered_parts` assembles requested parts (boxes) of the model's tensors on chosen ranks, one part
at a time (the HF export asks for one Hub tensor per part); `full_state_items` asks for whole tensors.
Both are collective when the model is sharded: every rank iterates them to the end, in the same order.

In: `load_weights` fills a model, sharded or not, from earlier weights (`init_from`): an HF directory
(each rank reads its slices), a Lightning checkpoint file (memory-mapped, each rank copies its
slices), or a sharded layout's checkpoint folder (DCP reshards into the model's layout; a DeepSpeed
folder is read whole).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .shards import Box, gather_box, local_box, local_tensor


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


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether some parameter of `model` is split over processes (DTensor or DeepSpeed ZeRO-3)."""
    return any(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in model.parameters())


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gathered_parts(model: torch.nn.Module, requests: Iterable[tuple[str, Box, int]]) -> Iterator[torch.Tensor | None]:
    """For each request (state-dict name, box, destination global rank): that part of the tensor, whole, on the
    destination rank, None on the others. DTensor parts are assembled from their shards (one part-sized buffer);
    a ZeRO-3 parameter is gathered whole by DeepSpeed, once for consecutive requests of it."""
    rank = rank_and_world()[0]
    state = model.state_dict(keep_vars=True)
    zero3 = _zero3_parameters(model)
    held_name, held = None, None
    for name, box, dst in requests:
        if name in zero3:
            if held_name != name:
                import deepspeed

                held = None  # free the previous parameter first
                with deepspeed.zero.GatheredParameters([zero3[name]], modifier_rank=None):
                    held, held_name = zero3[name].detach().clone(), name
            yield held[box] if rank == dst else None
        else:
            yield gather_box(state[name], box, dst)


def full_state_items(model: torch.nn.Module, dst: int = 0) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, whole tensor on global rank `dst`, None elsewhere) for every state-dict entry, in state-dict order."""
    shapes = state_shapes(model)
    requests = [(name, tuple(slice(0, n) for n in shape), dst) for name, (shape, _) in shapes.items()]
    yield from zip(shapes, gathered_parts(model, requests))


def is_writer() -> bool:
    """Whether this process writes shared files: global rank 0, or the only process."""
    return rank_and_world()[0] == 0


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Fill `model` (a GLM46ForCausalLM, whole or sharded) with the weights at `path` (see the module docstring).
    Only the weights: optimizer, schedules and data position start afresh."""
    from glm46.hf import load_hf

    path = Path(path)
    if path.is_dir() and (path / ".metadata").is_file() and any(isinstance(p, DTensor) for p in model.parameters()):
        _load_dcp(model, path)
        return
    state = read_sharded_checkpoint(path, model) if path.is_dir() else None
    if state is None and path.is_dir():
        load_hf(path, model=model)
        return
    if state is None:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        state = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    own = model.state_dict(keep_vars=True)
    if own.keys() != state.keys():
        missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        raise RuntimeError(f"{path}: the weights do not fit the model: missing {missing[:10]}, "
                           f"unexpected {unexpected[:10]}")
    with torch.no_grad():
        for name, tensor in own.items():
            box = local_box(tensor)
            if state[name].shape != tensor.shape:
                raise RuntimeError(f"{path}: {name} has shape {tuple(state[name].shape)}, the model "
                                   f"{tuple(tensor.shape)}")
            local_tensor(tensor).copy_(state[name][box])  # a memory-mapped source reads only this slice


def _load_dcp(model: torch.nn.Module, path: Path) -> None:
    """Read a distributed checkpoint's weights straight into the model's shards (DCP reshards as it reads)."""
    import torch.distributed.checkpoint as dcp

    state = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=path)


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
