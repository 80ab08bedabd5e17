"""The size on disk of a model's exports, from the Hub tensors' shapes alone (a meta-device model: no memory used).

bf16 is the training runs' `hf/` export (every tensor in bf16 but the router's correction bias, fp32); fp8 is
task=export's block-wise FP8 copy (glm46.checkpoint.fp8: one byte a quantized weight plus a float32 scale per block,
the rest as in bf16); gguf_* are task=export's GGUF files (glm46.checkpoint.gguf_export), q4_k_m by llama.cpp's type
rules. Headers, the index and GGUF's vocabulary are left out (kilobytes to a few MB).
"""

from __future__ import annotations

import math

import gguf
import torch

from glm46.checkpoint.fp8 import quantized, scale_shape, unquantized_dtype
from glm46.checkpoint.gguf_export import WEIGHT_TYPES, plan_tensors, q4_k_m_types
from glm46.checkpoint.hub_config import config_to_hf
from glm46.checkpoint.hub_keys import to_hf
from glm46.modules import GLM46Config, GLM46ForCausalLM


def hub_tensor_shapes(config: GLM46Config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = GLM46ForCausalLM(config)
    return {
        key: tuple(shape)
        for name, tensor in model.state_dict().items()
        for key, _, shape in to_hf(name, tensor.shape, config.num_hidden_layers)
    }


def export_bytes(config: GLM46Config, block: int = 128) -> dict[str, int]:
    """{"bf16", "fp8", "gguf_f16", "gguf_q8_0", "gguf_q4_k_m": bytes} of the exports' tensor data."""
    shapes = hub_tensor_shapes(config)
    sizes = {"bf16": 0, "fp8": 0}
    for key, shape in shapes.items():
        numel = math.prod(shape)
        plain = numel * unquantized_dtype(key).itemsize
        sizes["bf16"] += plain
        if quantized(key, shape):
            sizes["fp8"] += numel + math.prod(scale_shape(shape, block)) * torch.float32.itemsize
        else:
            sizes["fp8"] += plain
    hf_config = config_to_hf(config, torch.bfloat16)
    plans = {name: plan_tensors(shapes, hf_config, weights) for name, weights in WEIGHT_TYPES.items()}
    for name, tensors in plans.items():
        sizes[f"gguf_{name}"] = sum(t.nbytes for t in tensors)
    f16 = plans["f16"]
    blocks = config.num_hidden_layers + config.num_nextn_predict_layers
    sizes["gguf_q4_k_m"] = sum(
        math.prod(gguf.quant_shape_to_byte_shape(t.shape, qtype))
        for t, qtype in zip(f16, q4_k_m_types(f16, blocks, config.n_routed_experts))
    )
    return sizes
