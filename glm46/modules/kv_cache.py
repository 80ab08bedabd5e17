"""A preallocated key/value cache for all decoder layers, used by `generate()`."""

import torch

from .config import GLM46Config


class KVCache:
    def __init__(self, config: GLM46Config, batch_size: int, max_len: int, dtype: torch.dtype, device: torch.device):
        shape = (config.num_hidden_layers, batch_size, config.num_key_value_heads, max_len, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # tokens cached so far; the next token's position

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, kv_heads, T, head_dim] after the cached tokens; return all keys/values so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KVCache holds max_len={self.max_len} tokens; {end} requested")
        self.keys[layer_idx, :, :, self.length : end] = k
        self.values[layer_idx, :, :, self.length : end] = v
        return self.keys[layer_idx, :, :, :end], self.values[layer_idx, :, :, :end]

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens
