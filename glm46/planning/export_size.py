"""The size on disk of a model's exports, from the Hub tensors' shapes alone (a meta-device model: no memory used).

bf16 is the training runs' `hf/` export (every tensor in bf16 but the router's correction bias, fp32); fp8 is
task=export's block-wise FP8 copy (glm46.checkpoint.fp8: one byte a quantized weight plus a float32 scale per block,
the rest as in bf16). Headers and the index are left out (kilobytes).
"""

from __future__ import annotations

import math

import torch

from glm46.checkpoint.fp8 import quantized, scale_shape, unquantized_dtype
from glm46.checkpoint.hub_keys import to_hf
from glm46.modules import GLM46Config, GLM46ForCausalLM


def export_bytes(config: GLM46Config, block: int = 128) -> dict[str, int]:
    """{"bf16": bytes, "fp8": bytes} of the export's tensor data."""
    with torch.device("meta"):
        model = GLM46ForCausalLM(config)
    sizes = {"bf16": 0, "fp8": 0}
    for name, tensor in model.state_dict().items():
        for key, _, shape in to_hf(name, tensor.shape, config.num_hidden_layers):
            numel = math.prod(shape)
            plain = numel * unquantized_dtype(key).itemsize
            sizes["bf16"] += plain
            if quantized(key, shape):
                sizes["fp8"] += numel + math.prod(scale_shape(shape, block)) * torch.float32.itemsize
            else:
                sizes["fp8"] += plain
    return sizes
