"""Grouped-query attention with optional q/k/v bias, per-head QK RMSNorm before partial RoPE, and SDPA."""

import torch
import torch.nn.functional as F
from torch import nn

from .config import GLM46Config
from .kv_cache import KVCache
from .norm import RMSNorm
from .rope import apply_rotary_pos_emb


class Attention(nn.Module):
    def __init__(self, config: GLM46Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.use_qk_norm = config.use_qk_norm
        if self.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        document_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; with a cache, x holds the tokens after the cached ones.
        document_mask [B, 1, T, T] (packed documents): query i may see key j; causal within a document."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:  # over the full head_dim, before RoPE and before the GQA repeat
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, head_dim]
        q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)

        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.update(self.layer_idx, k, v)
        mask = document_mask
        if past > 0 and T > 1:  # a chunk after cached tokens: query i sees keys up to past + i
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None and past == 0 and T > 1,
            scale=self.head_dim**-0.5,
            enable_gqa=True,
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))
