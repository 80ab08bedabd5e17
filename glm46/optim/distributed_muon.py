"""Newton-Schulz on sharded Muon updates, with the work split across ranks instead of repeated on each.

Under FSDP2, tensor and expert parallelism an update is a DTensor: each rank holds a slice. Two cases:

- the slice is made of whole matrices (experts split on the expert dim, replicated or plain tensors): it is
  orthogonalised where it is, without communication;
- mesh dims that split rows or columns cut the matrices. The ranks along those dims (the parameter's
  matrix group) hold them together. Each such parameter gets one owner in the group, chosen greedily to
  balance the Newton-Schulz cost (largest first onto the least-loaded rank); one all-to-all brings every
  slice to its owner, the owner orthogonalises its whole matrices (same shapes batched), and a second
  all-to-all returns every rank its slices of the result.

This is torchtitan's DistMuon and Megatron-LM's LayerWiseDistributedOptimizer scheme (Dion does the same
with its own factorisation); the result equals single-process Muon. Owners work in rounds of at most
`round_bytes` of whole matrices per rank, so no rank ever holds more than that (or one matrix) at once.
`orthogonalize_updates` is collective: every rank calls it with the same parameters in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from glm46.parallel.boxes import Box, local_tensor, shift

from .newton_schulz import BATCH_BYTES, NewtonSchulz, consecutive_within, orthogonalize_batched


def splits_matrices(placement, ndim: int) -> bool:
    """Whether a placement of a tensor [..., rows, cols] cuts its matrices (Shard, _StridedShard: `.dim`)."""
    dim = getattr(placement, "dim", None)
    return dim is not None and dim % ndim >= ndim - 2


def matrix_dims(update: torch.Tensor) -> tuple[int, ...]:
    """The mesh dims of `update` that cut its matrices (none for a plain tensor)."""
    if not isinstance(update, DTensor):
        return ()
    return tuple(i for i, p in enumerate(update.placements) if splits_matrices(p, update.ndim))


def matrix_group(mesh: DeviceMesh, dims: tuple[int, ...]) -> dist.ProcessGroup:
    """The process group along mesh dims `dims` through this rank (a multi-dim group is a flattened mesh, which
    torch creates once and keeps on the root mesh)."""
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    names = tuple(mesh.mesh_dim_names[d] for d in dims)
    return mesh[names]._flatten("muon_" + "_".join(names)).get_group()


@dataclass
class ShardedJob:
    """One parameter's update in a matrix group: every member's box of it, and the box they make together."""

    update: DTensor
    spec: NewtonSchulz
    boxes: list[Box]  # per group rank, global index ranges
    whole: Box  # the union of the boxes: whole matrices (a subset of the experts under expert parallelism)

    @property
    def flops(self) -> int:
        return self.spec.flops(_shape(self.whole))

    @property
    def nbytes(self) -> int:
        return _numel(self.whole) * self.update.element_size()


_BOXES: dict[tuple, list[Box]] = {}


def _boxes(update: DTensor, members: list[int]) -> list[Box]:
    """Each member's box of `update` (fixed for a parameter's shape and placements: computed once)."""
    mesh = update.device_mesh
    key = (tuple(update.shape), tuple(update.placements), tuple(mesh.mesh.flatten().tolist()), tuple(members))
    if key not in _BOXES:
        boxes = []
        for rank in members:
            coordinate = (mesh.mesh == rank).nonzero()[0].tolist()
            shape, offset = _compute_local_shape_and_global_offset(
                update.shape, mesh.shape, coordinate, update.placements
            )
            boxes.append(tuple(slice(o, o + n) for o, n in zip(offset, shape)))
        _BOXES[key] = boxes
    return _BOXES[key]


def _shape(box: Box) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in box)


def _numel(box: Box) -> int:
    return math.prod(_shape(box))


def assign_owners(costs: list[int], ranks: int, load: list[int] | None = None) -> list[int]:
    """Owner rank per job: largest cost first, each onto the least-loaded rank (ties: lower job, lower rank).
    `load` (updated in place) carries earlier rounds' work."""
    load = load if load is not None else [0] * ranks
    owners = [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        owners[job] = min(range(ranks), key=lambda r: (load[r], r))
        load[owners[job]] += costs[job]
    return owners


def _exchange_round(jobs: list[ShardedJob], owners: list[int], group, me: int, size: int) -> list[torch.Tensor]:
    """Slices to owners, whole-matrix Newton-Schulz on the owners, slices back: this rank's slices of the result."""
    order = sorted(range(len(jobs)), key=lambda j: (owners[j], j))  # what this rank sends, grouped by owner
    mine = [jobs[j] for j in order if owners[j] == me]
    sent_splits = [sum(_numel(jobs[j].boxes[me]) for j in order if owners[j] == d) for d in range(size)]
    received_splits = [sum(_numel(job.boxes[s]) for job in mine) for s in range(size)]
    sent = torch.cat([local_tensor(jobs[j].update).reshape(-1) for j in order])
    received = sent.new_empty(sum(received_splits))
    dist.all_to_all_single(received, sent, received_splits, sent_splits, group=group)

    wholes = [received.new_empty(_shape(job.whole)) for job in mine]
    pieces = [(job, whole, job.boxes[s]) for s in range(size) for job, whole in zip(mine, wholes)]
    for (job, whole, box), piece in zip(pieces, received.split([_numel(box) for _, _, box in pieces])):
        whole[shift(box, job.whole)] = piece.view(_shape(box))
    orthogonal = orthogonalize_batched(wholes, [job.spec for job in mine])
    replies = [o[shift(job.boxes[s], job.whole)].reshape(-1) for s in range(size) for job, o in zip(mine, orthogonal)]

    replies = torch.cat([sent.new_empty(0), *replies])
    returned = sent.new_empty(sent.numel())
    dist.all_to_all_single(returned, replies, sent_splits, received_splits, group=group)
    slices = returned.split([_numel(jobs[j].boxes[me]) for j in order])
    results: list[torch.Tensor | None] = [None] * len(jobs)
    for j, piece in zip(order, slices):
        results[j] = piece.view(local_tensor(jobs[j].update).shape)
    return results


def _orthogonalize_group(
    updates: list[DTensor], specs: list[NewtonSchulz], dims: tuple[int, ...], round_bytes: int
) -> list[torch.Tensor]:
    group = matrix_group(updates[0].device_mesh, dims)
    members = dist.get_process_group_ranks(group)
    me, size = members.index(dist.get_rank()), len(members)
    jobs = []
    for update, spec in zip(updates, specs):
        boxes = _boxes(update, members)
        whole = tuple(slice(min(b[d].start for b in boxes), max(b[d].stop for b in boxes)) for d in range(update.ndim))
        jobs.append(ShardedJob(update, spec, boxes, whole))
    load, results = [0] * size, []
    for indices in consecutive_within([job.nbytes for job in jobs], round_bytes * size):
        round_jobs = [jobs[i] for i in indices]
        owners = assign_owners([job.flops for job in round_jobs], size, load)
        results += _exchange_round(round_jobs, owners, group, me, size)
    return results


def orthogonalize_updates(
    updates: list[torch.Tensor], specs: list[NewtonSchulz], round_bytes: int = BATCH_BYTES
) -> list[torch.Tensor]:
    """Newton-Schulz of every update (plain tensors or DTensors) -> this rank's local slice of each result,
    in the update's dtype. Collective over the DTensors' meshes."""
    results: list[torch.Tensor | None] = [None] * len(updates)
    in_place, groups = [], {}
    for i, update in enumerate(updates):
        dims = matrix_dims(update)
        if dims:  # parameter order: the same on every rank, so every group's collectives line up
            mesh = update.device_mesh
            groups.setdefault((mesh.mesh_dim_names, tuple(mesh.shape), dims), []).append(i)
        else:
            in_place.append(i)
    for (_, _, dims), indices in groups.items():
        orthogonal = _orthogonalize_group([updates[i] for i in indices], [specs[i] for i in indices], dims, round_bytes)
        for i, o in zip(indices, orthogonal):
            results[i] = o
    local = [local_tensor(updates[i]) for i in in_place]
    orthogonal = orthogonalize_batched(local, [specs[i] for i in in_place], round_bytes)
    for i, o in zip(in_place, orthogonal):
        results[i] = o
    return results
