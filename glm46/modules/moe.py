"""The MoE feed-forward: sigmoid top-k routing over stacked experts, plus always-on shared experts."""

import math
from typing import NamedTuple

import torch
from torch import nn

from .config import GLM46Config
from .experts import GroupedExperts
from .layers import MLP
from .router import TopkRouter


class RoutingStats(NamedTuple):
    counts: torch.Tensor  # [E] tokens routed to each expert, for the loss-free balancer
    balance_loss: torch.Tensor  # scalar: the sequence-wise balance loss (not yet weighted by alpha)


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, batch: int, splits=()) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss sum_i f_i P_i, averaged over the batch's sequences.

    scores [N, E] sigmoid scores, indices [N, k] selected experts, N = batch x T. f_i is expert i's
    share of the sequence's selections times E / k; P_i its mean score normalised over experts.
    splits: how the sequence is split over ranks (context, then sequence parallelism; objects with `size` and
    `sum`): these are this rank's T / (product of sizes) tokens of each row; f counts every rank's selections, P
    this rank's scores only, so the ranks' losses sum to the whole one.
    """
    num_experts, top_k = scores.shape[-1], indices.shape[-1]
    seq_len = scores.shape[0] // batch
    total = seq_len * math.prod(split.size for split in splits)
    probs = (scores / scores.sum(dim=-1, keepdim=True)).view(batch, seq_len, num_experts).sum(dim=1) / total
    selected = torch.zeros(batch, num_experts, device=scores.device)
    selected.scatter_add_(1, indices.view(batch, -1), torch.ones(batch, seq_len * top_k, device=scores.device))
    for split in splits:
        selected = split.sum(selected)
    share = selected * num_experts / (top_k * total)
    return (share * probs).sum(dim=-1).mean()


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
        # How the sequence is split over ranks, x holding this rank's tokens only (glm46.parallel sets it): context
        # parallelism's ContextShards, then sequence parallelism's SequenceShards, as far as they are on.
        self.token_splits = ()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RoutingStats]:
        """x [B, T, hidden] -> output [B, T, hidden], routing statistics."""
        shape = x.shape
        x = x.view(-1, shape[-1])  # [N, hidden]
        weights, indices, scores = self.gate(x)  # [N, k], [N, k], [N, E]
        flat_indices = indices.flatten()  # [N * k]
        rows = torch.bincount(flat_indices, minlength=self.num_experts)  # [E] of these tokens
        counts = rows
        for split in self.token_splits:  # of the whole sequences
            counts = split.sum(counts)
        order = flat_indices.argsort(stable=True)  # (token, slot) pairs grouped by expert
        inverse = order.argsort()  # each (token, slot) pair's place in `order`
        pairs = x[:, None].expand(-1, self.top_k, -1).reshape(-1, shape[-1])  # [N * k, hidden], (token, slot) order
        routed = self.experts(permute_rows(pairs, order, inverse), rows)  # [N * k, hidden], grouped by expert
        routed = permute_rows(routed, inverse, order).view(-1, self.top_k, shape[-1])  # back to (token, slot)
        out = (routed * weights[..., None]).sum(dim=1)  # sum_k weight_k * out_k (fp32 weights) [N, hidden]
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape), RoutingStats(
            counts, sequence_balance_loss(scores, indices, shape[0], self.token_splits)
        )
