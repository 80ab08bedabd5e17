"""Routed experts as stacked weights, run as one grouped matmul over tokens sorted by expert.

The layout is transformers v5's in-memory one: `gate_up_proj` [E, 2I, H] (rows [:I] gate,
[I:] up) and `down_proj` [E, H, I], so a weight is `nn.Linear`-shaped per expert.

Expert parallelism (opt-in, `glm46.parallel.expert.shard_experts`): the weights become DTensors
sharded on the expert dim over an `ep` process group, each rank holding E / ep consecutive experts.
The rows, still sorted by global expert, then travel to the rank owning their expert
(`all_to_all_single` with variable splits, counts exchanged first), are computed there with the
grouped matmul and come back in their original order. Without a group nothing changes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`F.linear(x_e, weight[e])` for consecutive row blocks x_e of sizes `counts`: x [M, in] -> [M, out].

    One `F.grouped_mm` call where the kernel accepts the operands (CPU, or bf16 on CUDA, with rows
    aligned to 16 bytes); otherwise a loop over experts.
    """
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    alignment = 16 // x.element_size()
    fused = (x.device.type == "cpu" or x.dtype == torch.bfloat16) and weight.dtype == x.dtype
    fused = fused and weight.shape[1] % alignment == 0 and weight.shape[2] % alignment == 0
    if fused:
        offsets = counts.cumsum(0, dtype=torch.int32)
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    blocks = x.split(counts.tolist())
    return torch.cat([F.linear(block, w) for block, w in zip(blocks, weight)])


def swiglu_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [M, hidden] sorted by expert, counts [E] -> SwiGLU expert outputs [M, hidden]."""
    gate, up = grouped_linear(x, gate_up, counts).chunk(2, dim=-1)
    return grouped_linear(F.silu(gate) * up, down, counts)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (differentiable), or the tensor itself."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; gradient times `scale` (see GroupedExperts.grad_scale)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group))


def expert_parallel_swiglu(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                           group: dist.ProcessGroup) -> torch.Tensor:
    """The experts of an ep group on the rows of this rank: x [M, hidden] sorted by global expert,
    counts [E] rows per global expert; gate_up, down hold this rank's E / ep experts -> [M, hidden]."""
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
        out = rows + 0 * (gate_up.sum() + down.sum())
    else:
        out = torch.empty_like(rows).index_copy(0, order, swiglu_experts(rows[order], gate_up, down, local_counts))
    return _all_to_all(out, input_splits, output_splits, group)


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # Expert parallelism (set by glm46.parallel.expert.shard_experts): the group exchanging tokens,
        # and the factor on the experts' gradients that makes them the mean over data-parallel ranks.
        self.ep_group: dist.ProcessGroup | None = None
        self.grad_scale = 1.0

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [M, hidden], rows sorted by expert; counts [E] rows per expert -> [M, hidden]."""
        gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
        if self.ep_group is None:
            return swiglu_experts(x, gate_up, down, counts)
        if self.grad_scale != 1.0:
            gate_up, down = _ScaleGrad.apply(gate_up, self.grad_scale), _ScaleGrad.apply(down, self.grad_scale)
        return expert_parallel_swiglu(x, counts, gate_up, down, self.ep_group)
