"""Token dispatch for expert parallelism: each ep rank holds E / ep consecutive experts, and the rows routed to
an expert travel to its rank and back (torchtitan's `ExpertParallel` token dispatch/combine, in
torchtitan/distributed/expert_parallel.py, does the same around its grouped experts).

`shard_experts` (glm46.parallel.parallelize) puts an ExpertParallelExperts in each MoE layer's place of its
GroupedExperts: the same parameter names, the weights sharded over the ep group, and a forward that exchanges the
rows; the model knows nothing of the collectives.

With tensor parallelism the ep groups span the TP ranks (Megatron's MoE parallel folding with
expert_tensor_parallel_size 1): without sequence parallelism the TP ranks of a group hold the same rows, so each
takes 1/tp of them (`split_blocks`, whose backward all-gathers the gradient) and the outputs are all-gathered back
(`gather_blocks`, whose backward keeps this rank's part; glm46.parallel.sequence_parallel): the experts then
compute every row once per TP group, not tp times, as Megatron's scatter/gather to the sequence-parallel region
do. With sequence parallelism each TP rank already holds its own tokens and sends them as they are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from glm46.modules.block_fp8 import BlockFp8, keep_fp8_scales
from glm46.modules.experts import GroupedExperts, swiglu_experts

from .boxes import local_box, local_tensor
from .sequence_parallel import block_sizes, gather_blocks, split_blocks


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; gradient times `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x, its gradient times `scale`."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


def rows_of_rank(counts: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    """Rows per expert in rank `rank`'s block of rows sorted by expert (counts [E] for all of them; blocks of
    `sizes` rows in rank order)."""
    lo = sum(sizes[:rank])
    end = counts.cumsum(0)
    return (end.clamp(max=lo + sizes[rank]) - (end - counts).clamp(min=lo)).clamp(min=0)


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group))


def expert_parallel_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor | BlockFp8,
    down: torch.Tensor | BlockFp8,
    group: dist.ProcessGroup,
    adapter: nn.ModuleDict | None = None,
) -> torch.Tensor:
    """The experts of an ep group on the rows of this rank: x [M, hidden] sorted by global expert,
    counts [E] rows per global expert; gate_up, down (and the adapters) hold this rank's E / ep experts
    -> [M, hidden]."""
    ep = dist.get_world_size(group)
    local_experts = gate_up.shape[0]
    with torch.no_grad():
        send = counts.view(ep, local_experts)  # rows for rank r's experts: send[r]
        received = torch.empty_like(send)  # received[s, e]: rows from rank s for local expert e
        dist.all_to_all_single(received, send.contiguous(), group=group)
    input_splits, output_splits = send.sum(dim=1).tolist(), received.sum(dim=1).tolist()
    rows = _all_to_all(x, output_splits, input_splits, group)  # blocks by (source rank, local expert)
    block_expert = torch.arange(local_experts, device=x.device).repeat(ep)
    expert_of_row = block_expert.repeat_interleave(received.flatten())
    order = expert_of_row.argsort(stable=True)  # -> rows by (local expert, source rank)
    local_counts = received.sum(dim=0)
    if rows.shape[0] == 0:  # nothing routed here: keep the weights in the graph, zero gradients
        adapted = [] if adapter is None else [local_tensor(p) for p in adapter.parameters()]
        trained = [w for w in (gate_up, down, *adapted) if isinstance(w, torch.Tensor) and w.requires_grad]
        out = rows + 0 * sum(w.sum() for w in trained)
    else:
        routed = swiglu_experts(rows[order], gate_up, down, local_counts, adapter)
        out = torch.empty_like(rows).index_copy(0, order, routed)
    return _all_to_all(out, input_splits, output_splits, group)


def _shard_experts_dim(owner: nn.Module, source: nn.Module, names, ep_mesh: DeviceMesh) -> None:
    """Register on `owner` each of `source`'s parameters `names` as a DTensor sharded on its expert dim (0) over ep."""
    for name in names:
        weight = getattr(source, name)
        sharded = distribute_tensor(weight.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
        owner.register_parameter(name, nn.Parameter(sharded, requires_grad=weight.requires_grad))


class ExpertParallelExperts(GroupedExperts):
    """GroupedExperts over an ep group: this rank holds E / ep consecutive experts (a DTensor Shard(0) over the ep
    mesh), and the rows routed to an expert travel to its rank and back. tp_group: the TP group whose ranks split
    their common rows when the two fold (None without TP, or under sequence parallelism); grad_scale: the factor on
    the experts' gradients that makes them the mean over the data-parallel ranks (see shard_experts)."""

    def __init__(
        self, experts: GroupedExperts, ep_mesh: DeviceMesh, grad_scale: float, tp_group: dist.ProcessGroup | None
    ):
        nn.Module.__init__(self)  # GroupedExperts' weights are `experts`' own, sharded: nothing allocated here
        self.num_experts = experts.num_experts
        _shard_experts_dim(self, experts, ("gate_up_proj", "down_proj"), ep_mesh)
        keep_fp8_scales(self, experts)  # every expert's, on every rank (glm46.peft.fp8_base's base)
        self.adapter = getattr(experts, "adapter", None)  # glm46.peft's AdaptedExperts: its pairs per expert
        for adapter in [] if self.adapter is None else self.adapter.values():
            _shard_experts_dim(adapter, adapter, [name for name, _ in adapter.named_parameters(recurse=False)], ep_mesh)
            adapter.grad_scale = grad_scale
        self.group, self.grad_scale, self.tp_group = ep_mesh.get_group(), grad_scale, tp_group

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        mine = local_box(self.gate_up_proj)[0]
        gate_up, down = (
            self.stored(name, scale_grad(getattr(self, name).to_local(), self.grad_scale), mine)
            for name in ("gate_up_proj", "down_proj")
        )
        if self.tp_group is None:
            return expert_parallel_swiglu(x, counts, gate_up, down, self.group, self.adapter)
        tp, rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
        sizes = block_sizes(x.shape[0], tp)
        mine = split_blocks(x, sizes, 0, self.tp_group)
        out = expert_parallel_swiglu(mine, rows_of_rank(counts, sizes, rank), gate_up, down, self.group, self.adapter)
        return gather_blocks(out, sizes, 0, self.tp_group)
