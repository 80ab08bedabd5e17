"""Token dispatch for expert parallelism: each ep rank holds E / ep consecutive experts, and the rows routed to
an expert travel to its rank and back (torchtitan's `ExpertParallel` token dispatch/combine, in
torchtitan/distributed/expert_parallel.py, does the same around its grouped experts).

`shard_experts` (glm46.parallel.parallelize) sets an ExpertDispatch as `GroupedExperts.dispatch`; the model
calls it in place of running its experts locally and knows nothing of the collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from glm46.modules.experts import swiglu_experts


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; gradient times `scale`."""

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


def expert_parallel_swiglu(
    x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
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


class ExpertDispatch:
    """The ep group exchanging tokens, and the factor on the experts' gradients that makes them the mean over
    the data-parallel ranks (see shard_experts)."""

    def __init__(self, group: dist.ProcessGroup, grad_scale: float):
        self.group, self.grad_scale = group, grad_scale

    def __call__(
        self, x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
    ) -> torch.Tensor:
        if self.grad_scale != 1.0:
            gate_up, down = _ScaleGrad.apply(gate_up, self.grad_scale), _ScaleGrad.apply(down, self.grad_scale)
        return expert_parallel_swiglu(x, counts, gate_up, down, self.group)
