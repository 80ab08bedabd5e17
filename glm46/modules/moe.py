"""The MoE feed-forward: sigmoid top-k routing over stacked experts, plus always-on shared experts."""

import torch
from torch import nn

from .config import GLM46Config
from .experts import GroupedExperts
from .mlp import MLP
from .router import TopkRouter


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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> output [B, T, hidden], tokens routed to each expert [E] (for the balancer)."""
        shape = x.shape
        x = x.view(-1, shape[-1])  # [N, hidden]
        weights, indices, _ = self.gate(x)  # [N, k]
        flat_indices = indices.flatten()  # [N * k]
        counts = torch.bincount(flat_indices, minlength=self.num_experts)
        order = flat_indices.argsort(stable=True)  # (token, slot) pairs grouped by expert
        token_of = order // self.top_k
        routed = self.experts(x[token_of], counts) * weights.flatten()[order, None]  # fp32 weights
        out = torch.zeros(x.shape, dtype=routed.dtype, device=x.device).index_add_(0, token_of, routed)
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape), counts
