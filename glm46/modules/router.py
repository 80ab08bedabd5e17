"""The GLM/DeepSeek-V3 sigmoid router with a correction bias that only steers selection.

The bias `e_score_correction_bias` is moved by the loss-free balancer (not by gradients); it picks
which experts a token goes to, while the gating weights stay the unbiased sigmoid scores.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import GLM46Config


class TopkRouter(nn.Module):
    def __init__(self, config: GLM46Config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def init_weights(self, std: float, normal_: Callable[[torch.Tensor, float], None]) -> None:
        normal_(self.weight, std)
        nn.init.zeros_(self.e_score_correction_bias)  # the balancer moves it from 0

    def _apply(self, fn, recurse=True):
        """Keep the correction bias in fp32 when the model is cast (transformers keeps it fp32 too)."""
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        cast = self.e_score_correction_bias
        if cast.dtype != torch.float32:
            source = cast if bias.is_meta else bias
            self.e_score_correction_bias = source.to(device=cast.device, dtype=torch.float32)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> gating weights [N, k] (fp32), expert indices [N, k], sigmoid scores [N, E]."""
        with torch.autocast(x.device.type, enabled=False):  # routing runs in fp32 even under autocast
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:  # keep the topk_group groups whose two best experts score highest
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, n_group]
            group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        indices = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, indices, scores
