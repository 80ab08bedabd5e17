"""Multi-token prediction (MTP) layer, with the semantics of transformers' MtpLayer and vLLM's glm4_moe_mtp.

MTP depth k at position i combines the previous hidden state at i (depth 1: the main model's
output after its final norm) with the embedding of token i+k, runs one MoE decoder layer at
RoPE position i+k, and normalises; the shared lm_head then predicts token i+k+1.
"""

import torch
from torch import nn

from .attention import Documents
from .config import GLM46Config
from .decoder import DecoderLayer
from .layers import RMSNorm
from .moe import RoutingStats


class MTPLayer(nn.Module):
    def __init__(self, config: GLM46Config, depth: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps=eps)
        self.hnorm = RMSNorm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # Checkpoints store MTP depth k as decoder layer num_hidden_layers + k - 1 (always an MoE layer).
        self.block = DecoderLayer(config, layer_idx=config.num_hidden_layers + depth - 1)
        self.norm = RMSNorm(hidden, eps=eps)  # `shared_head.norm` in checkpoints

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: Documents | None = None,
    ) -> tuple[torch.Tensor, RoutingStats]:
        """hidden, embeds [B, T, hidden] -> normed hidden [B, T, hidden] (fed to lm_head and the next depth)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))  # embedding first
        x, stats = self.block(x, cos, sin, documents=documents)
        return self.norm(x), stats
