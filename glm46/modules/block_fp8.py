"""Frozen weights stored in block-wise FP8 and dequantized per use (a PEFT run's base under `peft.base_dtype=fp8`:
glm46.peft.fp8_base puts them in place; checkpoints in this layout: glm46.checkpoint.fp8).

A matrix W [..., out, in] is stored as e4m3 values of its shape and a float32 `scale_inv` [..., out / block,
in / block] (rounded up), W = values x scale_inv block by block (DeepSeek-V3's `weight_dequant`; the name
notwithstanding, the stored scale multiplies). A stacked matrix of several parts (the experts' gate_up_proj: gate
rows then up rows) has its blocks per part, as the Hub stores one matrix per part: `part_rows` is a part's rows.

The matmuls dequantize the weight in the forward and again in the backward (`_Fp8Matmul`), so no dequantized copy
is kept for the backward: a layer holds one byte per weight between its uses. Only the input's gradient flows; the
values never train.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

SCALE_SUFFIX = "_scale_inv"  # `<weight name>_scale_inv`: the Hub's name for a weight's block scales
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
FP8 = torch.float8_e4m3fn


def scale_shape(shape: tuple[int, ...], block: int, part_rows: int | None = None) -> tuple[int, ...]:
    """The shape of `scale_inv` for a matrix of `shape` [..., out, in] with parts of `part_rows` rows (all: one)."""
    *lead, rows, cols = shape
    part_rows = part_rows or rows
    return (*lead, rows // part_rows * math.ceil(part_rows / block), math.ceil(cols / block))


def quantize(weight: torch.Tensor, block: int, part_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., out, in] -> (e4m3 values of its shape, float32 scale_inv): each block (of each part) scaled so that its
    largest magnitude maps to E4M3's largest (448)."""
    *lead, rows, cols = weight.shape
    part_rows = part_rows or rows
    parts = weight.float().unflatten(-2, (rows // part_rows, part_rows))  # [..., parts, part_rows, cols]
    row_blocks, col_blocks = math.ceil(part_rows / block), math.ceil(cols / block)
    padded = parts.new_zeros(*parts.shape[:-2], row_blocks * block, col_blocks * block)
    padded[..., :part_rows, :cols] = parts
    blocks = padded.unflatten(-1, (col_blocks, block)).unflatten(-3, (row_blocks, block))  # [.., rb, b, cb, b]
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / E4M3_MAX  # [..., parts, rb, cb]
    values = (blocks / scale[..., :, None, :, None]).flatten(-2).flatten(-3, -2)[..., :part_rows, :cols]
    return values.to(FP8).flatten(-3, -2), scale.flatten(-3, -2)


def dequantize(
    values: torch.Tensor,
    scale_inv: torch.Tensor,
    block: int,
    part_rows: int | None = None,
    box: tuple[slice, ...] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The weights in `dtype` of e4m3 `values`: all of a matrix whose scales are `scale_inv`, or with `box` the part
    of it at those global index ranges, `scale_inv` then the whole matrix's. part_rows: a part's rows, whose blocks
    start afresh (None: one part)."""
    *lead, rows, cols = box or tuple(slice(0, n) for n in values.shape)
    if box is not None:
        scale_inv = scale_inv[tuple(lead)]
    row = torch.arange(rows.start, rows.stop, device=values.device)
    if part_rows is None:
        row_block = row // block
    else:
        row_block = row // part_rows * math.ceil(part_rows / block) + row % part_rows // block
    col_block = torch.arange(cols.start, cols.stop, device=values.device) // block
    expanded = scale_inv[..., row_block, :][..., col_block]
    return (values.float() * expanded).to(dtype)


class BlockFp8(NamedTuple):
    """A weight as a layer computes with it in block FP8: its values (this rank's, rows and columns whole), their
    scale_inv, the block and a part's rows."""

    values: torch.Tensor
    scale_inv: torch.Tensor
    block: int
    part_rows: int | None = None

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.values, self.scale_inv, self.block, self.part_rows, dtype=dtype)


def dense(weight: torch.Tensor | BlockFp8, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a tensor: a BlockFp8 dequantized to `dtype`, a tensor as it is."""
    return weight.dense(dtype) if isinstance(weight, BlockFp8) else weight


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `x` computes in: autocast's where it is on, else x's."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


class _Fp8Matmul(torch.autograd.Function):
    """matmul(x, W) (+ a frozen bias, added as F.linear adds it) with W dequantized in the forward and again in the
    backward, where the input's gradient is matmul(grad, W^T); `matmul`: F.linear, or grouped_linear over the rows of
    each expert. Gradient for x alone."""

    @staticmethod
    def forward(ctx, x, values, scale_inv, block, part_rows, matmul, bias):
        ctx.save_for_backward(values, scale_inv)
        ctx.block, ctx.part_rows, ctx.matmul, ctx.dtype = block, part_rows, matmul, compute_dtype(x)
        weight = dequantize(values, scale_inv, block, part_rows, dtype=ctx.dtype)
        x = x.to(ctx.dtype)
        return matmul(x, weight) if bias is None else F.linear(x, weight, bias.to(ctx.dtype))

    @staticmethod
    def backward(ctx, grad):
        values, scale_inv = ctx.saved_tensors
        weight = dequantize(values, scale_inv, ctx.block, ctx.part_rows, dtype=ctx.dtype)
        grad_x = ctx.matmul(grad.to(ctx.dtype), weight.transpose(-2, -1).contiguous())
        return grad_x, None, None, None, None, None, None


def fp8_matmul(x: torch.Tensor, weight: BlockFp8, matmul=F.linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """matmul(x, W) for a block-FP8 W: F.linear's by default, with a frozen `bias`."""
    return _Fp8Matmul.apply(x, weight.values, weight.scale_inv, weight.block, weight.part_rows, matmul, bias)


def keep_fp8_scales(module: nn.Module, source: nn.Module) -> None:
    """Give `module`, which takes `source`'s place with its weights (adapted or expert-parallel experts), the block
    scales and block of those weights, where they are stored in block FP8."""
    for name, scale_inv in source.named_buffers(recurse=False):
        if name.endswith(SCALE_SUFFIX):
            module.register_buffer(name, scale_inv)
    if getattr(source, "fp8_block", None) is not None:
        module.fp8_block = source.fp8_block
