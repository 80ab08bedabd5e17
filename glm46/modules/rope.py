"""Partial rotary position embedding (NeoX rotate-half) over the first `rotary_dim` dims of each head.

GLM-4.5/4.6 rotate only the first half of every 128-dim q/k head; `inv_freq` is spread over the
rotary dim (64), not head_dim. The dense GLM-4 interleaves pairs instead; glm4_moe does not.
"""

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device=None) -> torch.Tensor:
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
        return 1.0 / (self.theta**exponent)

    def reset_parameters(self) -> None:
        """Recompute the (non-persistent) buffer, e.g. after building the model on the meta device."""
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> cos, sin [B, T, rotary_dim], computed in fp32."""
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, T, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, head_dim]; cos/sin [B, T, rotary_dim]. Dims past rotary_dim pass through."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x_rot = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1)
