"""The small building blocks of the GLM-4.5/4.6 decoder: RMSNorm, the dense SwiGLU MLP, and partial RoPE."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Computed in fp32 and cast back before the weight, as transformers' Glm4MoeRMSNorm does."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def init_weights(self, std: float, normal_: Callable[[torch.Tensor, float], None]) -> None:
        self.reset_parameters()  # unit weights, whatever the std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class MLP(nn.Module):
    """Dense SwiGLU feed-forward: the first `first_k_dense_replace` layers and the shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RotaryEmbedding(nn.Module):
    """Partial rotary position embedding (NeoX rotate-half) over the first `rotary_dim` dims of each head.

    GLM-4.5/4.6 rotate only the first half of every 128-dim q/k head; `inv_freq` is spread over the rotary dim (64),
    not head_dim. The dense GLM-4 interleaves pairs instead; glm4_moe does not."""

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

    def init_weights(self, std: float, normal_: Callable[[torch.Tensor, float], None]) -> None:
        self.reset_parameters()

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
