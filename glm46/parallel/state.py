"""The state of a model that may be sharded by FSDP2, TP, EP (DTensors) or DeepSpeed ZeRO-3: shapes, and parts
assembled on chosen ranks.

`gathered_parts` assembles requested parts (boxes) of the model's tensors on chosen ranks, one part at a time
(the HF export asks for one Hub tensor per part); `full_state_items` asks for whole tensors. Both are
collective when the model is sharded: every rank iterates them to the end, in the same order. A pipeline part
(pipeline_parallel.split_model) holds only its stages' tensors: the names and shapes of the others come from
the ranks that hold them, and each part is summed in from its stage (glm46.parallel.boxes.sum_box).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .boxes import Box, gather_box, sum_box


def _zero3_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if hasattr(p, "ds_id")}


def state_shapes(model: torch.nn.Module) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Name -> (full shape, dtype) of every state-dict entry, in state-dict order; without communication unless
    `model` is a pipeline part."""
    shapes = _own_shapes(model)
    return _whole_model_shapes(model, shapes)[0] if is_pipeline_part(model) else shapes


def _own_shapes(model: torch.nn.Module) -> dict[str, tuple[torch.Size, torch.dtype]]:
    zero3 = _zero3_parameters(model)
    shapes = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        shape = zero3[name].ds_shape if name in zero3 else tensor.shape  # DTensor.shape is the full shape
        shapes[name] = (torch.Size(shape), tensor.dtype)
    return shapes


def is_pipeline_part(model: torch.nn.Module) -> bool:
    """Whether `model` holds only some pipeline stages' parts (a GLM46ForCausalLM split by split_model)."""
    return callable(getattr(model, "is_whole", None)) and not model.is_whole()


def _whole_model_shapes(model: torch.nn.Module, own: dict) -> tuple[dict[str, tuple[torch.Size, torch.dtype]], int]:
    """Every stage's entries, in the whole model's state-dict order, and the first global rank that holds the
    same stages as this one (collective: the parts tell their shapes; the ranks of one pipeline rank's slice of
    the mesh hold the same entries, those of other slices none of them)."""
    from glm46.modules import GLM46ForCausalLM

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, own)
    merged = {name: entry for part in parts for name, entry in part.items()}
    with torch.device("meta"):
        order = list(GLM46ForCausalLM(model.config).state_dict().keys())
    known = set(order)
    order += [name for name in merged if name not in known]  # what the base has not: adapters (glm46.peft)
    first_rank = next(rank for rank, part in enumerate(parts) if part.keys() == own.keys())
    return {name: merged[name] for name in order}, first_rank


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
    pipeline = is_pipeline_part(model)
    if pipeline:
        shapes, first_rank = _whole_model_shapes(model, _own_shapes(model))
        device = next(model.parameters()).device
    for name, box, dst in requests:
        if pipeline:
            yield sum_box(state.get(name), box, dst, shapes[name][1], device, first_rank)
        elif name in zero3:
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
