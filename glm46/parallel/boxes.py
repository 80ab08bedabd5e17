"""A rank's piece of a global tensor, as index ranges ("boxes"), to read and write sharded weights without
ever holding a whole one.

A DTensor (FSDP2, tensor or expert parallel) holds on each rank one contiguous box of the global tensor:
`local_box` gives its index ranges, also for FSDP2 over tensor parallelism (`_StridedShard`), whose local
block is still contiguous. Loading fills that box from a source that can slice (safetensors' `get_slice`,
an mmap-ed checkpoint); exporting assembles one requested box (one Hub tensor) on one rank with
`gather_box`, so memory holds at most that box beyond the shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

Box = tuple[slice, ...]


def local_box(tensor: torch.Tensor) -> Box:
    """The global index ranges of this rank's part of `tensor`: a DTensor's local shard, or all of a plain tensor."""
    if not isinstance(tensor, DTensor):
        return tuple(slice(0, n) for n in tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's local data (a view: writing it writes the parameter)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when they do not overlap."""
    common = tuple(slice(max(x.start, y.start), min(x.stop, y.stop)) for x, y in zip(a, b))
    return None if any(s.start >= s.stop for s in common) else common


def shift(box: Box, origin: Box) -> Box:
    """`box` in the coordinates of a tensor that starts at `origin`'s corner."""
    return tuple(slice(s.start - o.start, s.stop - o.start) for s, o in zip(box, origin))


def is_canonical_holder(tensor: DTensor, first_rank: int = 0) -> bool:
    """Whether this rank is the one copy of its piece that counts: replicas of a piece live on the mesh dims
    where the DTensor is replicated and on the mesh (the root mesh's dims outside the DTensor's), so the piece
    counts on coordinate 0 of the former within the sub-mesh that holds `first_rank`, the first global rank of
    the ranks holding the tensor (0; under pipeline parallelism the first of its stage's)."""
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    on_first_mesh = bool((mesh.mesh == first_rank).any())
    return on_first_mesh and all(c == 0 for c, p in zip(coordinate, tensor.placements) if isinstance(p, Replicate))


def gather_box(tensor: torch.Tensor, box: Box, dst: int) -> torch.Tensor | None:
    """The part `box` of the global `tensor`, whole, on global rank `dst` (None elsewhere). Collective when the
    tensor is a DTensor: every rank calls it with the same arguments. Each piece of the box is summed in from
    its canonical holder (all other ranks add zeros), so memory holds one box-sized buffer beyond the shards."""
    if not isinstance(tensor, DTensor):
        return tensor.detach()[box] if not dist.is_initialized() or dist.get_rank() == dst else None
    local = tensor.to_local()
    return sum_box(tensor, box, dst, local.dtype, local.device)


def sum_box(
    tensor: torch.Tensor | None,
    box: Box,
    dst: int,
    dtype: torch.dtype,
    device: torch.device,
    first_rank: int = 0,
) -> torch.Tensor | None:
    """gather_box for a tensor that only some ranks hold (a pipeline stage's, first global rank `first_rank`):
    `tensor` is None on the others, which add zeros. Collective over all ranks."""
    buffer = torch.zeros([s.stop - s.start for s in box], dtype=dtype, device=device)
    if tensor is not None:
        local, mine = local_tensor(tensor).detach(), local_box(tensor)
        common = intersect(mine, box)
        sharded = isinstance(tensor, DTensor)
        holder = is_canonical_holder(tensor, first_rank) if sharded else dist.get_rank() == first_rank
        if common is not None and holder:
            buffer[shift(common, box)] = local[shift(common, mine)]
    # FP8 (a PEFT run's block-FP8 base) has no sum in the collectives: its bytes add, one holder's to zeros
    dist.reduce(buffer.view(torch.uint8) if dtype.itemsize == 1 else buffer, dst=dst, op=dist.ReduceOp.SUM)
    return buffer if dist.get_rank() == dst else None
