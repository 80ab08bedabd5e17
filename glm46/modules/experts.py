"""Routed experts as stacked weights, run as one grouped matmul over tokens sorted by expert.

The layout is transformers v5's in-memory one: `gate_up_proj` [E, 2I, H] (rows [:I] gate,
[I:] up) and `down_proj` [E, H, I], so a weight is `nn.Linear`-shaped per expert.
"""

import torch
import torch.nn.functional as F
from torch import nn


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`F.linear(x_e, weight[e])` for consecutive row blocks x_e of sizes `counts`: x [M, in] -> [M, out].

    One `F.grouped_mm` call where the kernel accepts the operands (CPU, or bf16 on CUDA, with rows
    aligned to 16 bytes); otherwise a loop over experts.
    """
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    alignment = 16 // x.element_size()
    fused = (x.device.type == "cpu" or x.dtype == torch.bfloat16) and weight.dtype == x.dtype
    fused = fused and weight.shape[1] % alignment == 0 and weight.shape[2] % alignment == 0
    if fused:
        offsets = counts.cumsum(0, dtype=torch.int32)
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    blocks = x.split(counts.tolist())
    return torch.cat([F.linear(block, w) for block, w in zip(blocks, weight)])


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [M, hidden], rows sorted by expert; counts [E] rows per expert -> [M, hidden]."""
        gate, up = grouped_linear(x, self.gate_up_proj, counts).chunk(2, dim=-1)
        return grouped_linear(F.silu(gate) * up, self.down_proj, counts)
