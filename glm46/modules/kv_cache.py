"""A preallocated key/value cache for all decoder layers, used by `generate()`."""

import torch

from .config import GLM46Config


class KVCache:
    def __init__(self, config: GLM46Config, batch_size: int, max_len: int, dtype: torch.dtype, device: torch.device):
        shape = (config.num_hidden_layers, batch_size, config.num_key_value_heads, max_len, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # tokens cached so far
        self.valid: torch.Tensor | None = None  # [B, max_len] which cached keys are real tokens; None: all are

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, kv_heads, T, head_dim] after the cached tokens; return all keys/values so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KVCache holds max_len={self.max_len} tokens; {end} requested")
        self.keys[layer_idx, :, :, self.length : end] = k
        self.values[layer_idx, :, :, self.length : end] = v
        return self.keys[layer_idx, :, :, :end], self.values[layer_idx, :, :, :end]

    def mark_padding(self, attention_mask: torch.Tensor) -> None:
        """attention_mask [B, T] (0 for padding) of the next tokens to be cached: attention then skips their pad
        keys. Tokens cached without a mark count as real."""
        if self.valid is None:
            self.valid = torch.ones(self.keys.shape[1], self.max_len, dtype=torch.bool, device=self.keys.device)
        self.valid[:, self.length : self.length + attention_mask.shape[1]] = attention_mask.bool()

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens
