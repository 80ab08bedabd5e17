"""The MoE feed-forward: sigmoid top-k routing over stacked experts, plus always-on shared experts."""

from typing import NamedTuple

import torch
from torch import nn

from .config import GLM46Config
from .experts import GroupedExperts
from .layers import MLP
from .router import TopkRouter


class RoutingStats(NamedTuple):
    """What an MoE layer's routing did, for the loss-free balancer and DeepSeek-V3's sequence-wise balance loss.

    Under a token split (context or sequence parallelism) a layer sees only this rank's tokens of each row; the
    parallel code's forward hook (glm46.parallel.sharded_tokens) then sums `counts` and `selections` over the ranks and
    counts `tokens` of the whole rows, so that the ranks' balance losses sum to the whole one."""

    counts: torch.Tensor  # [E] tokens routed to each expert
    selections: torch.Tensor  # [B, E] per row: how often its tokens selected each expert (no gradient)
    scores: torch.Tensor  # [B, E] per row: its tokens' scores, normalised over the experts, summed over the tokens
    tokens: int  # tokens per row
    top_k: int

    def balance_loss(self) -> torch.Tensor:
        """sum_i f_i P_i averaged over the rows: f_i is expert i's share of the row's selections times E / k, P_i its
        mean normalised score (of the scores summed here: this rank's part of it under a token split)."""
        num_experts = self.scores.shape[-1]
        probs = self.scores / self.tokens
        share = self.selections * num_experts / (self.top_k * self.tokens)
        return (share * probs).sum(dim=-1).mean()


def routing_stats(rows: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor, batch: int) -> RoutingStats:
    """rows [E] tokens per expert, scores [N, E] sigmoid scores and indices [N, k] selected experts of N = batch x T
    tokens -> their RoutingStats."""
    num_experts, top_k = scores.shape[-1], indices.shape[-1]
    seq_len = scores.shape[0] // batch
    summed = (scores / scores.sum(dim=-1, keepdim=True)).view(batch, seq_len, num_experts).sum(dim=1)
    selections = torch.zeros(batch, num_experts, device=scores.device)
    selections.scatter_add_(1, indices.view(batch, -1), torch.ones(batch, seq_len * top_k, device=scores.device))
    return RoutingStats(rows, selections, summed, seq_len, top_k)


class _PermuteRows(torch.autograd.Function):
    """x[order] for a permutation `order`, whose gradient is the gather by its inverse: autograd's index backward
    would scatter-add instead, which the CPU runs serially."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x [M, ...] with its rows in `order`, a permutation of range(M) whose inverse is `inverse`."""
    return _PermuteRows.apply(x, order, inverse)


class MoE(nn.Module):
    def __init__(self, config: GLM46Config):
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.gate = TopkRouter(config)
        self.experts = GroupedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = None
        if config.n_shared_experts > 0:
            self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RoutingStats]:
        """x [B, T, hidden] -> output [B, T, hidden], routing statistics."""
        shape = x.shape
        x = x.view(-1, shape[-1])  # [N, hidden]
        weights, indices, scores = self.gate(x)  # [N, k], [N, k], [N, E]
        flat_indices = indices.flatten()  # [N * k]
        # [E] rows per expert, of a size known without reading the device (bincount sizes its output by the largest id)
        rows = flat_indices.new_zeros(self.num_experts).scatter_add_(0, flat_indices, torch.ones_like(flat_indices))
        order = flat_indices.argsort(stable=True)  # (token, slot) pairs grouped by expert
        inverse = order.argsort()  # each (token, slot) pair's place in `order`
        pairs = x[:, None].expand(-1, self.top_k, -1).reshape(-1, shape[-1])  # [N * k, hidden], (token, slot) order
        routed = self.experts(permute_rows(pairs, order, inverse), rows)  # [N * k, hidden], grouped by expert
        routed = permute_rows(routed, inverse, order).view(-1, self.top_k, shape[-1])  # back to (token, slot)
        out = (routed * weights[..., None]).sum(dim=1)  # sum_k weight_k * out_k (fp32 weights) [N, hidden]
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape), routing_stats(rows, scores, indices, shape[0])
