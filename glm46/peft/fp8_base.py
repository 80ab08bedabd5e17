"""A PEFT run's frozen base in block FP8 (`peft.base_dtype=fp8`): one byte a weight for the matrices of the decoder
layers, dequantized per use (glm46.modules.block_fp8), the rest in bf16, as GLM-4.6-FP8 is released.

The matrices quantized are those of the main model's decoder layers (attention's q, k, v, o; the dense MLPs; the
shared and routed experts); the embedding, the lm_head, the routers, the norms and the MTP layers stay in bf16 (the
Hub's FP8 releases keep the first four so; the MTP layers are 1/93 of GLM-4.6). A weight keeps its name, now in
e4m3, with its block scales beside it as the buffer `<name>_scale_inv` (the Hub's layout), whole on every rank:
FSDP2 shards and gathers the values like any parameter and leaves buffers alone, and expert parallelism slices the
scales by its experts in the forward. The scales are 1/4,096 of the values' bytes at 128 x 128 blocks (fp32 each).

An nn.Linear so stored becomes an Fp8Linear (the class swapped, as FSDP2 does), whose `weight` is the dequantized
weight for every reader (DoRA's norms, the merge); its forward never builds it whole for the backward. A weight with
its scales is FP8 values in whatever dtype holds them: FSDP2's bf16-mixed policy gathers every parameter in bf16,
which holds e4m3's values exactly (the shards stay FP8; the gathered layer takes two bytes a weight meanwhile).
glm46.checkpoint.hf_read fills the values and scales: bit for bit from a block-FP8 checkpoint, or quantized from a
bf16 one. Exports (`hf/`, RL's weight pushes) dequantize first (`dequantized_base`): the merged model is bf16.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from glm46.modules import GLM46ForCausalLM
from glm46.modules.block_fp8 import FP8, SCALE_SUFFIX, BlockFp8, dequantize, fp8_matmul, quantize, scale_shape
from glm46.modules.experts import part_rows
from glm46.parallel.boxes import local_box, local_tensor

BLOCK = 128  # GLM-4.6-FP8's and DeepSeek-V3's weight_block_size (a block-FP8 init_from brings its own)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


class Fp8Linear(nn.Linear):
    """An nn.Linear whose `weight` parameter holds e4m3 values, with `weight_scale_inv` and `fp8_block`."""

    fp8_block: int

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight in bf16, as a bf16 base holds it. A DTensor is FSDP2's sharded storage outside a
        forward, which FSDP2 reads back by this name (the forward sees it gathered, a plain tensor): that is the
        parameter itself (glm46.peft.inject.adapted_weights dequantizes it for DoRA's norms and the merge)."""
        weight = self._parameters["weight"]
        return weight if isinstance(weight, DTensor) else dense_weight(self, "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, scale_inv = self._parameters["weight"], self._buffers.get("weight" + SCALE_SUFFIX)
        if scale_inv is None:  # dequantized for the length of a block (dequantized_base)
            return nn.functional.linear(x, weight, self.bias)
        return fp8_matmul(x, BlockFp8(weight, scale_inv, self.fp8_block), bias=self.bias)


def stored_in_fp8(model: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """(module, weight name) of every weight that a block-FP8 base stores in FP8, in the model's order."""
    for layer in model.model.layers.values():
        for path in LINEARS:
            yield layer.get_submodule(path), "weight"
        mlps = [layer.mlp] if not layer.is_moe else [m for m in [layer.mlp.shared_experts] if m is not None]
        for mlp in mlps:
            for name in MLP_LINEARS:
                yield getattr(mlp, name), "weight"
        if layer.is_moe:
            for name in ("gate_up_proj", "down_proj"):
                yield layer.mlp.experts, name


@torch.no_grad()
def quantize_base(model: GLM46ForCausalLM, block: int = BLOCK) -> None:
    """Store the base's decoder-layer matrices in block FP8, in place (on the model's device, meta included; the
    values are the weights' own, quantized, until glm46.checkpoint.hf_read fills them)."""
    for module, name in stored_in_fp8(model):
        weight = module._parameters[name]
        rows = part_rows(name, weight.shape[-2])
        if weight.is_meta:
            values = torch.empty(weight.shape, dtype=FP8, device="meta")
            scale_inv = torch.empty(scale_shape(weight.shape, block, rows), device="meta")
        else:
            values, scale_inv = quantize(weight, block, rows)
        module._parameters[name] = nn.Parameter(values, requires_grad=False)
        module.register_buffer(name + SCALE_SUFFIX, scale_inv)
        module.fp8_block = block
        if type(module) is nn.Linear:
            module.__class__ = Fp8Linear


def dense_weight(module: nn.Module, name: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight `name` of `module` as a tensor: dequantized where it is stored in block FP8 (this rank's part of it,
    a DTensor with the parameter's placements where it is one), else the parameter itself."""
    weight, scale_inv = module._parameters[name], module._buffers.get(name + SCALE_SUFFIX)
    if scale_inv is None:
        return weight
    rows = part_rows(name, weight.shape[-2])
    local = dequantize(local_tensor(weight), scale_inv, module.fp8_block, rows, local_box(weight), dtype)
    if not isinstance(weight, DTensor):
        return local
    return DTensor.from_local(
        local, weight.device_mesh, weight.placements, shape=weight.shape, stride=weight.stride(), run_check=False
    )


def dequantize_base(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> list[tuple[nn.Module, str, tuple]]:
    """Put each block-FP8 weight's dequantized value (in `dtype`, each rank its part) in its place, its scales taken
    out: the model is then a plain one (an export reads it). Returns what was taken out: (module, name, (the FP8
    parameter, its scales))."""
    taken = []
    for module, name in stored_in_fp8(model):
        if name + SCALE_SUFFIX in module._buffers:
            dense = nn.Parameter(dense_weight(module, name, dtype), requires_grad=False)
            taken.append((module, name, (module._parameters[name], module._buffers.pop(name + SCALE_SUFFIX))))
            module._parameters[name] = dense
    return taken


@contextmanager
def dequantized_base(model: nn.Module) -> Iterator[None]:
    """The base in bf16 inside the block (RL's weight pushes write it), its FP8 values and scales back after it.
    No-op for a base not in FP8."""
    taken = dequantize_base(model)
    try:
        yield
    finally:
        for module, name, (weight, scale_inv) in taken:
            module._parameters[name] = weight
            module.register_buffer(name + SCALE_SUFFIX, scale_inv)
