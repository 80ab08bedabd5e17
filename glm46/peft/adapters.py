"""LoRA and DoRA adapters on glm46's linear layers and stacked experts, computed as the peft library computes them.

LoRA (Hu et al. 2021, arXiv:2106.09685): y = W x + s B A dropout(x), s = alpha / r, A [r, in] drawn as torch's
nn.Linear draws (U(-1/sqrt(in), 1/sqrt(in)), peft's default) and B [out, r] zero, so training starts at the base.

DoRA (Liu et al. 2024, arXiv:2402.09353), as peft's DoraLinearLayer: a magnitude m [out] (initialised to the row
norms of W) and the direction W + s B A, whose row norm is treated as a constant (the paper's section 4.3):
y = W x + (m / n - 1) W x + (m / n) s B A dropout(x) + bias, n = ||W + s B A||_row detached.

A routed expert weight [E, out, in] gets either a pair per expert (A [E, r, in], B [E, out, r]; Megatron-Bridge's and
peft's `target_parameters` layout) or one pair shared by the layer's experts (A [r, in], B [out, r]; slime's). Both
run as grouped matmuls over the rows sorted by expert (glm46.modules.experts.grouped_linear), with no loop.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from glm46.modules.block_fp8 import BlockFp8, dense, keep_fp8_scales
from glm46.modules.experts import GroupedExperts, grouped_linear, swiglu_experts
from glm46.parallel.boxes import local_box, local_tensor
from glm46.parallel.expert_dispatch import scale_grad


class Adapter(nn.Module):
    """The low-rank pair (and DoRA's magnitude) of one weight; `active` False gives the base layer's output."""

    def __init__(self, a_shape, b_shape, magnitude_shape, alpha: float, dropout: float, dora: bool):
        super().__init__()
        rank = a_shape[-2]
        self.lora_A = nn.Parameter(torch.empty(a_shape))
        self.lora_B = nn.Parameter(torch.empty(b_shape))
        self.lora_magnitude_vector = nn.Parameter(torch.empty(magnitude_shape)) if dora else None
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.active = True

    @property
    def rank(self) -> int:
        return self.lora_A.shape[-2]

    @torch.no_grad()
    def reset_parameters(self, weight: torch.Tensor, generator: torch.Generator | None = None) -> None:
        """A as peft draws it, B zero, DoRA's magnitude the row norms of the base `weight` (whole or sharded)."""
        bound = 1 / math.sqrt(self.lora_A.shape[-1])
        drawn = torch.empty(self.lora_A.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
        fill_from_whole(self.lora_A, drawn)
        local_tensor(self.lora_B).zero_()
        if self.lora_magnitude_vector is not None:
            self.reset_magnitude(weight)

    @torch.no_grad()
    def reset_magnitude(self, weight: torch.Tensor) -> None:
        """DoRA's magnitude: the row norms of `weight` + the current delta (peft's DoraLinearLayer.update_layer), from
        a whole or sharded weight. Each rank gives the norms of its rows, and the largest value found wins (the other
        ranks' are zeros, or a replica's equal value)."""
        _, row_norms = self.merged_rows(weight)
        norms = torch.zeros(weight.shape[:-1], dtype=torch.float32, device=row_norms.device)
        norms[local_box(weight)[:-1]] = row_norms
        mesh = getattr(weight, "device_mesh", None)
        for dim in range(mesh.ndim if mesh is not None else 0):
            dist.all_reduce(norms, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        fill_from_whole(self.lora_magnitude_vector, norms.cpu())

    def delta(self, box: tuple[slice, ...]) -> torch.Tensor:
        """s B A over `box` of the weight ([out, in], or [E, out, in] per expert; a shared pair is every expert's)."""
        lora_A, lora_B = gathered(self.lora_A), gathered(self.lora_B)
        if lora_A.ndim == 3:
            return self.scaling * (lora_B[box[0], box[1]] @ lora_A[box[0], :, box[2]])
        delta = self.scaling * (lora_B[box[-2]] @ lora_A[:, box[-1]])
        return delta.expand(box[0].stop - box[0].start, *delta.shape) if len(box) == 3 else delta

    def merged_rows(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of W + s B A (`weight` whole, or a DTensor), and the fp32 norms of its whole rows: a
        weight split along its inputs (tensor parallelism's row-parallel layers) sums their squares over the ranks
        holding the rest of each row (collective then)."""
        local, box = local_tensor(weight), local_box(weight)
        merged = local + self.delta(box).to(local.device, local.dtype)
        squares = merged.float().pow(2).sum(-1)
        for dim, placement in enumerate(getattr(weight, "placements", ())):
            if placement.is_shard(weight.ndim - 1):
                dist.all_reduce(squares, group=weight.device_mesh.get_group(dim))
        return merged, squares.sqrt()

    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's part of the weight that gives the adapted output alone (the merged export's)."""
        merged, norms = self.merged_rows(weight)
        if self.lora_magnitude_vector is None:
            return merged
        magnitude = gathered(self.lora_magnitude_vector)[local_box(weight)[:-1]].to(merged.device)
        return merged * (magnitude / norms)[..., None].to(merged.dtype)


class LinearAdapter(Adapter):
    """On an nn.Linear (attention, the dense MLP, the shared experts): `adapt` turns base(x) into the adapted output
    (glm46.peft.inject hooks it onto the layer's forward)."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, dora: bool = False):
        super().__init__((r, base.in_features), (base.out_features, r), (base.out_features,), alpha, dropout, dora)
        self.hook = None  # the handle of the forward hook that applies it (glm46.peft.inject)

    def distribute(self, tp_mesh: DeviceMesh, column: bool) -> None:
        """Split as tensor parallelism splits the base (glm46.parallel.parallelize), Megatron's LoRA under TP: a
        column-parallel weight's rows, so B's rows and DoRA's magnitudes (A whole on every rank); a row-parallel
        weight's inputs, so A's inputs (B and the magnitudes whole). The adapted output then has the base output's
        placement: a column slice, or a partial sum that the row-parallel layer's reduction completes."""
        split = {"lora_A": Shard(1), "lora_B": None, "lora_magnitude_vector": None}
        if column:
            split = {"lora_A": None, "lora_B": Shard(0), "lora_magnitude_vector": Shard(0)}
        for name, placement in split.items():
            parameter = getattr(self, name)
            if parameter is not None:
                tensor = distribute_tensor(parameter.data, tp_mesh, [placement or Replicate()])
                setattr(self, name, nn.Parameter(tensor, requires_grad=parameter.requires_grad))

    def adapt(self, base: nn.Linear, x: torch.Tensor, base_out: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return base_out
        lora_A, lora_B, magnitude = (
            _gradient_summed(p) for p in (self.lora_A, self.lora_B, self.lora_magnitude_vector)
        )
        dropped = self.dropout(x)
        lora = F.linear(F.linear(dropped, lora_A), lora_B) * self.scaling
        if magnitude is None:
            return base_out + lora
        weight = base.weight
        delta = self.scaling * (lora_B @ lora_A).detach()
        norm = torch.linalg.norm(weight + delta.to(weight.dtype), dim=1).detach()
        scale = magnitude / norm
        if isinstance(self.dropout, nn.Identity) or not self.training:  # peft reuses the base output then
            plain = base_out if base.bias is None else base_out - base.bias
        else:
            plain = F.linear(dropped, weight)
        return base_out + (scale - 1) * plain + scale * lora


class ExpertAdapter(Adapter):
    """On a stacked expert weight [E, out, in]: a pair per expert, or one pair for all (`shared`)."""

    def __init__(self, weight_shape, r: int, alpha: float, shared: bool, dora: bool = False):
        num_experts, out_features, in_features = weight_shape
        stack = () if shared else (num_experts,)
        super().__init__(
            (*stack, r, in_features), (*stack, out_features, r), (num_experts, out_features), alpha, 0, dora
        )
        self.shared = shared
        self.grad_scale = 1.0  # expert parallelism's factor on the experts' gradients (glm46.parallel.expert_dispatch)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | BlockFp8, counts: torch.Tensor) -> torch.Tensor:
        """grouped_linear(x, weight, counts) adapted: x [M, in] sorted by expert, weight this rank's [E, out, in]."""
        base_out = grouped_linear(x, weight, counts)
        if not self.active:
            return base_out
        lora_A, lora_B = (scale_grad(local_tensor(p), self.grad_scale) for p in (self.lora_A, self.lora_B))
        if self.shared:
            lora = F.linear(F.linear(x, lora_A), lora_B)
        else:
            lora = grouped_linear(grouped_linear(x, lora_A, counts), lora_B, counts)
        lora = lora * self.scaling
        if self.lora_magnitude_vector is None:
            return base_out + lora
        delta = self.scaling * (lora_B @ lora_A).detach()  # [E, out, in], or [out, in] for every expert
        weight = dense(weight, base_out.dtype)  # a block-FP8 base dequantized
        norm = torch.linalg.norm(weight + delta.to(weight.dtype), dim=-1).detach()  # [E, out]
        experts = torch.arange(len(counts), device=x.device)
        expert_of_row = torch.repeat_interleave(experts, counts, output_size=x.shape[0])  # no read of counts
        magnitude = scale_grad(local_tensor(self.lora_magnitude_vector), self.grad_scale)
        scale = (magnitude / norm)[expert_of_row]  # [M, out]
        return base_out + (scale - 1) * base_out + scale * lora


class AdaptedExperts(GroupedExperts):
    """GroupedExperts with adapters on its weights (`adapter`: ExpertAdapters by weight name; None once merged): the
    same parameters, under the same names, put in the model's place by glm46.peft.inject (as expert parallelism puts
    its own subclass), so that the model's experts hold no adapter state."""

    def __init__(self, experts: GroupedExperts, adapter: nn.ModuleDict):
        nn.Module.__init__(self)  # GroupedExperts' weights are `experts`' own: nothing allocated here
        self.num_experts = experts.num_experts
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        keep_fp8_scales(self, experts)
        self.adapter = adapter

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate_up, down = (self.stored(name, local_tensor(getattr(self, name))) for name in ("gate_up_proj", "down_proj"))
        return swiglu_experts(x, gate_up, down, counts, self.adapter)


def _gradient_summed(parameter: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter whole on every tensor-parallel rank, each of which computes part of its gradient (from its rows or
    its inputs), as a DTensor whose backward all-reduces that gradient (DTensor.from_local's); else it would stay a
    partial sum. Any other parameter as it is."""
    if isinstance(parameter, DTensor) and any(p.is_replicate() for p in parameter.placements):
        return DTensor.from_local(parameter.to_local(), parameter.device_mesh, parameter.placements, run_check=False)
    return parameter


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (adapters are small), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def fill_from_whole(parameter: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy into `parameter` (whole, or a DTensor's shard) its part of the whole tensor `whole`."""
    local = local_tensor(parameter)
    local.copy_(whole[local_box(parameter)].to(local.dtype))
