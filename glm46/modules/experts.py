"""Routed experts as stacked weights, run as one grouped matmul over tokens sorted by expert.

The layout is transformers v5's in-memory one: `gate_up_proj` [E, 2I, H] (rows [:I] gate,
[I:] up) and `down_proj` [E, H, I], so a weight is `nn.Linear`-shaped per expert.

Expert parallelism is the parallel code's (glm46.parallel.expert_dispatch.ExpertParallelExperts): it puts a
subclass in this module's place, with the same weights sharded on the expert dim, whose forward sends the rows to
their experts' ranks and back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .block_fp8 import SCALE_SUFFIX, BlockFp8, fp8_matmul

# torch's grouped matmul: F.grouped_mm where this torch has it public, else the private op it wraps (torch._grouped_mm,
# CUDA bf16 only), for torches before it went public
grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


@torch.compiler.disable
def _grouped_mm_untraced(x: torch.Tensor, weight_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """F.grouped_mm kept out of torch.compile's graphs: in torch 2.13 its meta kernel accepts bf16 only, so tracing
    the CPU's fp32 call fails; compiled, the experts run eagerly between the compiled regions."""
    return grouped_mm(x, weight_t, offs=offs)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor | BlockFp8, counts: torch.Tensor) -> torch.Tensor:
    """`F.linear(x_e, weight[e])` for consecutive row blocks x_e of sizes `counts`: x [M, in] -> [M, out].

    One `F.grouped_mm` call where the kernel accepts the operands (CPU, or bf16 on CUDA, with rows
    aligned to 16 bytes); otherwise a loop over experts. A block-FP8 weight is dequantized per use.
    """
    if isinstance(weight, BlockFp8):
        return fp8_matmul(x, weight, lambda rows, dense: grouped_linear(rows, dense, counts))
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    alignment = 16 // x.element_size()
    fused = (x.device.type == "cpu" or x.dtype == torch.bfloat16) and weight.dtype == x.dtype
    fused = fused and weight.shape[1] % alignment == 0 and weight.shape[2] % alignment == 0
    if fused:
        offsets = counts.cumsum(0, dtype=torch.int32)
        matmul = grouped_mm if x.dtype == torch.bfloat16 else _grouped_mm_untraced
        return matmul(x, weight.transpose(-2, -1), offs=offsets)
    blocks = x.split(counts.tolist())
    return torch.cat([F.linear(block, w) for block, w in zip(blocks, weight)])


def swiglu_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: torch.Tensor,
    adapter: nn.ModuleDict | None = None,
) -> torch.Tensor:
    """x [M, hidden] sorted by expert, counts [E] -> SwiGLU expert outputs [M, hidden]. adapter: what computes a weight
    in place of grouped_linear, by weight name (`gate_up_proj`, `down_proj`), each with `linear(x, weight, counts)`:
    the low-rank adapters that glm46.peft puts on the experts from outside."""

    def linear(name: str, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if adapter is not None and name in adapter:
            return adapter[name].linear(rows, weight, counts)
        return grouped_linear(rows, weight, counts)

    gate, up = linear("gate_up_proj", x, gate_up).chunk(2, dim=-1)
    return linear("down_proj", F.silu(gate) * up, down)


def part_rows(name: str, rows: int) -> int | None:
    """The rows of one part of a weight with `rows` rows: half for `gate_up_proj` (gate rows, then up rows), None
    for a weight of one part (block-FP8 storage starts a part's blocks afresh: glm46.modules.block_fp8)."""
    return rows // 2 if name == "gate_up_proj" else None


def _local(weight: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (differentiable), or the tensor itself."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class GroupedExperts(nn.Module):
    fp8_block: int | None = None  # the block of weights stored in block FP8 (a PEFT run's base: glm46.peft.fp8_base)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def init_weights(self, std: float, normal_: Callable[[torch.Tensor, float], None]) -> None:
        normal_(self.gate_up_proj, std)
        normal_(self.down_proj, std)

    def stored(self, name: str, weight: torch.Tensor, experts: slice = slice(None)) -> torch.Tensor | BlockFp8:
        """This rank's data `weight` of the weight `name` (of `experts`) as the matmuls take it: block FP8 where the
        module holds the weight's `<name>_scale_inv` (of every expert; the values in FP8, or in bf16 as FSDP2's
        mixed precision gathers them), else the tensor itself."""
        scale_inv = self._buffers.get(name + SCALE_SUFFIX)
        if scale_inv is None:
            return weight
        return BlockFp8(weight, scale_inv[experts], self.fp8_block, part_rows(name, weight.shape[-2]))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [M, hidden], rows sorted by expert; counts [E] rows per expert -> [M, hidden]."""
        gate_up = self.stored("gate_up_proj", _local(self.gate_up_proj))
        return swiglu_experts(x, gate_up, self.stored("down_proj", _local(self.down_proj)), counts)
