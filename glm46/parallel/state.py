"""Weights in and out of a model that may be sharded by FSDP2, TP, EP (DTensors) or DeepSpeed ZeRO-3.

Out: `gathered_parts` assembles requested parts (boxes) of the model's tensors on chosen ranks, one part
at a time (the HF export asks for one Hub tensor per part); `full_state_items` asks for whole tensors.
Both are collective when the model is sharded: every rank iterates them to the end, in the same order.

In: `load_weights` fills a model, sharded or not, from earlier weights (`init_from`): an HF directory
(each rank reads its slices), a Lightning checkpoint file (memory-mapped, each rank copies its
slices), or a sharded layout's checkpoint folder (DCP reads in place, resharding into the model's
layout; a DeepSpeed folder is read whole).
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
    if (path / ".metadata").is_file():
        _load_dcp(model, path)
        return
    if path.is_dir() and not _is_deepspeed_folder(path):
        load_hf(path, model=model)
        return
    if path.is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(path)  # whole, in one process
    else:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)["state_dict"]
    state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    own = model.state_dict(keep_vars=True)
    if own.keys() != state.keys():
        missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        raise RuntimeError(
            f"{path}: the weights do not fit the model: missing {missing[:10]}, unexpected {unexpected[:10]}"
        )
    with torch.no_grad():
        for name, tensor in own.items():
            if state[name].shape != tensor.shape:
                raise RuntimeError(
                    f"{path}: {name} has shape {tuple(state[name].shape)}, the model {tuple(tensor.shape)}"
                )
            local_tensor(tensor).copy_(state[name][local_box(tensor)])  # a memory-mapped source reads only this


def _is_deepspeed_folder(path: Path) -> bool:
    return (path / "latest").is_file() or bool(list(path.glob("*/zero_pp_rank_*_model_states.pt")))


def _load_dcp(model: torch.nn.Module, path: Path) -> None:
    """Read a distributed checkpoint (the mesh layouts' checkpoint folders: `*.distcp` + `.metadata`) into the
    model in place: each rank reads its shards, whatever layout wrote it (DCP reshards), or the whole weights
    into a whole model, also in one process. The LightningModule's `model.` prefix is in the checkpoint."""
    import torch.distributed.checkpoint as dcp

    state = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}  # views of the weights
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": reading in one process is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=not (dist.is_available() and dist.is_initialized()))
