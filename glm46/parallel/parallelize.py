"""Apply a Layout to a plain GLM46ForCausalLM, in place, with torch's own engines:
tensor parallelism (`parallelize_module`), expert parallelism (experts as DTensors sharded over `ep`,
tokens all-to-all in GroupedExperts), activation checkpointing (composable `checkpoint`, names
unchanged) and FSDP2 (`fully_shard` per decoder layer, experts on their own mesh, then the root).

Order matters and follows torchtitan: pipeline split (pipeline_parallel.split_model, on the meta model, before
this), TP, EP, CP, activation checkpointing, FSDP; under pipeline parallelism each stage is an FSDP root.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from glm46.modules.layers import RMSNorm
from glm46.modules.model import GLM46ForCausalLM, decoder_layers

from .checkpointing import apply_activation_checkpointing
from .context_parallel import ContextParallelAttention, ContextShards
from .expert_dispatch import ExpertParallelExperts
from .layout import Layout, expert_split_dim
from .mesh import hsdp_mesh
from .sharded_tokens import install_routing_sums, token_split


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; gradient summed over `group` (Megatron's copy-to-tensor-parallel-region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class HeadParallelRMSNorm(RMSNorm):
    """The per-head QK RMSNorm of a tensor-parallel attention: each rank normalises its own heads with
    the one shared weight, whose gradient is therefore the sum over the tensor-parallel ranks."""

    def __init__(self, norm: RMSNorm, group):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = norm.weight  # the same parameter: names and values unchanged
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return _AllReduceGrad.apply(self.weight, self.group) * x.to(dtype)


def apply_tensor_parallel(model: GLM46ForCausalLM, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Megatron-style TP: q/k/v and gate/up column-parallel (heads and intermediate features split), o_proj and
    down_proj row-parallel (outputs all-reduced), in attention, the dense MLPs and the shared experts, each with its
    adapter (glm46.peft.adapters.LinearAdapter.distribute); the router, norms, embedding and lm_head stay replicated
    (every TP rank sees the same tokens), and so do the routed experts unless expert parallelism folds them over TP
    (shard_experts). The QK norms see only their rank's heads, so
    their weight gradients are summed over the TP ranks (HeadParallelRMSNorm).

    With `sequence_parallel` the regions take the sequence split over the TP ranks and give it back split
    (glm46.parallel.sequence_parallel): inputs all-gathered, row-parallel outputs reduce-scattered over the tokens
    (dim 1 of [B, T, hidden]; dim 0 of the shared experts' [B x T, hidden])."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()

    def row_parallel(dim: int) -> RowwiseParallel:
        return RowwiseParallel(output_layouts=Shard(dim)) if sequence_parallel else RowwiseParallel()

    def gathered(module: nn.Module, dim: int, arguments: int = 1) -> None:
        """The module's first input all-gathered over the tokens (`dim`), its other inputs as they are."""
        layouts = (Shard(dim),) + (None,) * (arguments - 1)
        wanted = (Replicate(),) + (None,) * (arguments - 1)
        style = PrepareModuleInput(input_layouts=layouts, desired_input_layouts=wanted, use_local_output=False)
        parallelize_module(module, tp_mesh, style)

    def split_linears(module: nn.Module, plan: dict) -> None:
        """parallelize_module over `plan`'s linear layers. An adapter on one of them (glm46.peft) is set aside
        meanwhile, as torch's styles cannot register its dotted parameter names, and split by its own `distribute`."""
        aside = {name: getattr(module, name)._modules.pop("adapter", None) for name in plan}
        parallelize_module(module, tp_mesh, plan)
        for name, adapter in aside.items():
            if adapter is not None:
                adapter.distribute(tp_mesh, column=isinstance(plan[name], ColwiseParallel))
                getattr(module, name).adapter = adapter

    for layer in decoder_layers(model):
        attention = layer.self_attn
        split_linears(
            attention,
            {
                "q_proj": ColwiseParallel(),
                "k_proj": ColwiseParallel(),
                "v_proj": ColwiseParallel(),
                "o_proj": row_parallel(1),
            },
        )
        attention.num_heads //= tp  # the heads of this rank: q/k/v outputs are local column slices
        attention.num_kv_heads //= tp
        if attention.use_qk_norm:
            attention.q_norm = HeadParallelRMSNorm(attention.q_norm, tp_mesh.get_group())
            attention.k_norm = HeadParallelRMSNorm(attention.k_norm, tp_mesh.get_group())
        mlp = layer.mlp.shared_experts if layer.is_moe else layer.mlp
        token_dim = 0 if layer.is_moe else 1  # the MoE runs its shared experts on [B x T, hidden]
        if mlp is not None:
            plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": row_parallel(token_dim)}
            split_linears(mlp, plan)
        if sequence_parallel:
            gathered(attention, 1, arguments=5)  # (x, cos, sin, cache, documents)
            if mlp is not None:
                gathered(mlp, token_dim)


def shard_experts(
    model: GLM46ForCausalLM, ep_mesh: DeviceMesh, data_parallel_span: int, tp_mesh: DeviceMesh | None = None
) -> None:
    """Each ep rank keeps E / ep consecutive experts (a DTensor Shard(0) over `ep`) and exchanges tokens
    with its ep group; with `tp_mesh` (the groups fold over TP, without sequence parallelism) each TP rank sends 1/tp
    of its group's common tokens. An expert's gradient then sums the loss gradients of all tokens of the
    `data_parallel_span` data-parallel ranks its ep group spans (Layout.expert_parallel_dp; times cp, whose ranks'
    losses are scaled by cp, when the group spans the context-parallel ranks): the factor 1 / that
    here, with FSDP's mean over the ranks holding the same experts, makes it the mean over all data-parallel ranks,
    as for every other weight."""
    for layer in decoder_layers(model):
        if not layer.is_moe:
            continue
        tp_group = tp_mesh.get_group() if tp_mesh is not None else None
        layer.mlp.experts = ExpertParallelExperts(layer.mlp.experts, ep_mesh, 1.0 / data_parallel_span, tp_group)


def apply_context_parallel(model: GLM46ForCausalLM, shards: ContextShards) -> None:
    """Each cp rank runs its load-balanced chunks of every sequence (glm46.parallel.context_parallel): the training
    step passes the model a token split that takes them from the whole rows (glm46.parallel.sharded_tokens), and
    attention all-gathers the keys and values. The cp ranks hold the same weights: apply_fsdp shards them over
    dp_shard_cp, whose gradient mean over cp the training step undoes (the rank's loss is its tokens' part)."""
    for layer in decoder_layers(model):
        layer.self_attn.inner_attention = ContextParallelAttention(shards)


def fsdp_policy(precision: str | int, explicit: Mapping[str, str | None]) -> dict[str, str] | None:
    """The FSDP2 policy: `explicit` (param_dtype, reduce_dtype) when either dtype is set, else the one that matches
    Lightning's `trainer.precision`: "*-mixed" keeps fp32 parameters and computes in the low dtype with fp32
    gradient reductions; the "*-true" precisions (and fp32) need none."""
    if any(explicit.values()):
        return dict(explicit)
    low = {"bf16-mixed": "bfloat16", "16-mixed": "float16"}.get(str(precision))
    return {"param_dtype": low, "reduce_dtype": "float32"} if low else None


def mixed_precision_policy(settings) -> torch.distributed.fsdp.MixedPrecisionPolicy:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not settings:
        return MixedPrecisionPolicy()
    dtype = {k: getattr(torch, settings[k]) if settings.get(k) else None for k in ("param_dtype", "reduce_dtype")}
    return MixedPrecisionPolicy(param_dtype=dtype["param_dtype"], reduce_dtype=dtype["reduce_dtype"])


def apply_fsdp(
    model: GLM46ForCausalLM,
    mesh: DeviceMesh,
    expert_parallel: bool,
    mixed_precision=None,
    reshard_after_forward: bool = True,
    roots: list[nn.Module] | None = None,
) -> None:
    """fully_shard per decoder layer and MTP layer, then the root (embedding, final norm, lm_head): the model, or
    under pipeline parallelism each of this rank's stages (`roots`, whose forward the schedule calls).
    With expert parallelism the experts get their own fully_shard first, over the ranks holding the
    same experts (`edp_*`, split as layout.expert_split_dim says), so the layer's group over `dp_*`
    leaves them alone."""
    from torch.distributed.fsdp import fully_shard

    dense_mesh = hsdp_mesh(mesh, "dp_replicate", "dp_shard_cp")
    kwargs = {"mp_policy": mixed_precision_policy(mixed_precision), "reshard_after_forward": reshard_after_forward}
    if expert_parallel:
        expert_mesh = hsdp_mesh(mesh, "edp_replicate", "edp_shard")
        local_experts = model.config.n_routed_experts // mesh["ep"].size()
        placement = Shard(expert_split_dim(local_experts, mesh["edp_shard"].size()))
        for layer in decoder_layers(model):
            if layer.is_moe:
                fully_shard(layer.mlp.experts, mesh=expert_mesh, shard_placement_fn=lambda _: placement, **kwargs)
    for layer in model.model.layers.values():
        fully_shard(layer, mesh=dense_mesh, **kwargs)
    for mtp in model.mtp_layers:
        fully_shard(mtp, mesh=dense_mesh, **kwargs)
    for root in roots or [model]:
        fully_shard(root, mesh=dense_mesh, mp_policy=kwargs["mp_policy"], reshard_after_forward=False)


def parallelize(
    model: GLM46ForCausalLM,
    layout: Layout,
    mesh: DeviceMesh,
    activation_checkpointing: str | None = None,
    mixed_precision=None,
    stages: list[nn.Module] | None = None,
) -> GLM46ForCausalLM:
    """Apply `layout` over `mesh` (glm46.parallel.mesh.build_mesh) to `model`, in place; `activation_checkpointing`:
    None, or a mode of glm46.parallel.checkpointing; `stages`: the pipeline stages of this rank, when the model was
    split (their modules are the model's)."""
    split = token_split(layout, mesh)
    if layout.tensor_parallel > 1:
        apply_tensor_parallel(model, mesh["tp"], layout.sequence_parallel)
    if layout.expert_parallel > 1:  # folded over TP without sequence parallelism, the TP ranks split their tokens
        split_tokens = layout.experts_fold_tp and not layout.sequence_parallel
        # the tokens an expert sees are of expert_parallel_dp batches, each the loss of cp ranks (scaled by cp)
        span = layout.expert_parallel_dp * layout.context_parallel
        shard_experts(model, mesh["ep"], span, mesh["tp"] if split_tokens else None)
    if split is not None and split.context is not None:
        apply_context_parallel(model, split.context)
    if split is not None:  # the MoE layers see this rank's tokens: count the whole rows'
        install_routing_sums(model, split)
    if activation_checkpointing:
        apply_activation_checkpointing(model, activation_checkpointing)
    # A pipeline stage is an FSDP2 root even on one data-parallel rank (a no-op there): its weights are then
    # DTensors, and its checkpoint a DCP folder that Lightning's ModelParallelStrategy loads, as every mesh layout's.
    # So is a model with a mixed-precision policy: bf16 weights in the step and fp32 masters on one GPU as on many
    # (torch's own path, as torchtitan takes it), instead of autocast casting the fp32 weights at every use.
    if layout.shards_weights or stages or mixed_precision:
        apply_fsdp(model, mesh, layout.expert_parallel > 1, mixed_precision, layout.reshards_after_forward, stages)
    return model
