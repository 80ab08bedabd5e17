"""A pre-norm decoder layer: attention, then a dense SwiGLU (first k layers) or the MoE."""

import torch
from torch import nn

from .attention import Attention, Documents
from .config import GLM46Config
from .generation import KVCache
from .layers import MLP, RMSNorm
from .moe import MoE, RoutingStats


class DecoderLayer(nn.Module):
    def __init__(self, config: GLM46Config, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.is_moe = layer_idx >= config.first_k_dense_replace
        self.mlp = MoE(config) if self.is_moe else MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        documents: Documents | None = None,
    ) -> tuple[torch.Tensor, RoutingStats | None]:
        """x [B, T, hidden] -> x [B, T, hidden], and an MoE layer's routing statistics."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, documents)
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            h, stats = self.mlp(h)
            return x + h, stats
        return x + self.mlp(h), None
