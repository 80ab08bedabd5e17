"""Put adapters on a GLM46ForCausalLM's targets, freeze everything else, and find them again.

The base keeps its parameter names (loading, the layouts and the HF export read them unchanged): an nn.Linear's
adapter is its child `adapter`, applied by a forward hook; a layer's experts become AdaptedExperts, whose `adapter`
ModuleDict (by weight name) acts inside the grouped matmuls (glm46.modules.experts.swiglu_experts). Only the main
model's decoder layers are adapted: the MTP layers, the routers and their correction biases stay as they were (the
balancer leaves a PEFT run's biases alone), and the embedding and lm_head train whole only when named.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from glm46.modules import GLM46ForCausalLM
from glm46.modules.experts import GroupedExperts

from .adapters import AdaptedExperts, Adapter, ExpertAdapter, LinearAdapter
from .fp8_base import BLOCK, dense_weight, quantize_base
from .settings import TRAINED_WHOLE, AdapterSettings
from .token_rows import TokenRows, add_token_rows

ADAPTER = ".adapter."  # in the name of every adapter tensor, and of no base tensor


def is_adapter_name(name: str) -> bool:
    return ADAPTER in f".{name}"


def _adapted_forward(module: nn.Linear, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return module.adapter.adapt(module, args[0], output)


def _adapt_linear(linear: nn.Linear, settings: AdapterSettings) -> None:
    linear.adapter = LinearAdapter(linear, settings.r, settings.alpha, settings.dropout, settings.dora)
    linear.adapter.hook = linear.register_forward_hook(_adapted_forward)


def add_adapters(
    model: GLM46ForCausalLM, settings: AdapterSettings, token_indices: list[int] | None = None, fp8_block: int = BLOCK
) -> None:
    """Freeze the model (in settings.base_dtype; fp8: blocks of `fp8_block`, init_from's where it is block FP8) and
    add the adapters of `settings.targets`, and trainable rows of the embedding and lm_head for `token_indices`
    (settings.trainable_tokens' ids: glm46.peft.token_rows), built on the device the model is on (meta included:
    glm46.parallel.materialize allocates them, `reset_adapters` fills them)."""
    base_dtype = torch.bfloat16 if settings.base_dtype == "fp8" else getattr(torch, settings.base_dtype)
    for p in model.parameters():
        p.requires_grad_(False)
        p.data = p.data.to(base_dtype)  # buffers (the correction biases, RoPE's frequencies) keep theirs
    if settings.base_dtype == "fp8":
        quantize_base(model, fp8_block)  # the decoder layers' matrices, the rest in bf16
    targets = settings.target_names()
    for layer in model.model.layers.values():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if name in targets:
                _adapt_linear(getattr(layer.self_attn, name), settings)
        mlps = [layer.mlp] if not layer.is_moe and "dense_mlp" in targets else []
        if layer.is_moe and layer.mlp.shared_experts is not None and "shared_experts" in targets:
            mlps.append(layer.mlp.shared_experts)
        for mlp in mlps:
            for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                _adapt_linear(linear, settings)
        if layer.is_moe and "experts" in targets:
            experts = layer.mlp.experts
            shared = settings.experts == "shared"
            adapter = {
                name: ExpertAdapter(getattr(experts, name).shape, settings.r, settings.alpha, shared, settings.dora)
                for name in ("gate_up_proj", "down_proj")
            }
            layer.mlp.experts = AdaptedExperts(experts, nn.ModuleDict(adapter))
    for name in TRAINED_WHOLE:
        if name in targets:
            module = model.lm_head if name == "lm_head" else model.model.embed_tokens
            module.weight.requires_grad_(True)
    if token_indices:
        for name, layer in (("embed_tokens", model.model.embed_tokens), ("lm_head", model.lm_head)):
            if name not in targets:  # trained whole otherwise
                add_token_rows(layer, token_indices)
    for name, p in model.named_parameters():
        if is_adapter_name(name) or p.requires_grad:
            p.data = p.data.float()  # what trains (and its optimizer) in fp32 whatever the base
            p.requires_grad_(True)


def adapted_weights(model: nn.Module) -> Iterator[tuple[str, Adapter | TokenRows, torch.Tensor]]:
    """(the base weight's name, its adapter, the base weight) for every adapted weight, in the model's order: the
    low-rank adapters and the trainable token rows. A weight stored in block FP8 comes dequantized (a copy: merging
    into it takes glm46.peft.fp8_base.dequantize_base first)."""
    for name, module in model.named_modules():
        adapter = getattr(module, "adapter", None)
        if isinstance(adapter, LinearAdapter):
            yield f"{name}.weight", adapter, dense_weight(module, "weight")
        elif isinstance(adapter, TokenRows):
            yield f"{name}.weight", adapter, module._parameters["weight"]  # `weight` holds the rows in place
        elif isinstance(module, GroupedExperts) and adapter is not None:
            for weight_name, expert_adapter in adapter.items():
                yield f"{name}.{weight_name}", expert_adapter, dense_weight(module, weight_name)


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters' tensors by name."""
    return {name: p for name, p in model.named_parameters() if is_adapter_name(name)}


def base_state_dict(model: nn.Module, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """The model's state dict without its adapters: what a base checkpoint holds."""
    return {k: v for k, v in model.state_dict(keep_vars=keep_vars).items() if not is_adapter_name(k)}


@torch.no_grad()
def reset_adapters(model: nn.Module, seed: int) -> None:
    """Initialise every adapter as peft does (A drawn, B zero, DoRA's magnitude from the loaded base weights): after
    the base weights are in place. Each adapter draws from a generator seeded by the seed and its weight's name, so
    every rank and layout (a pipeline stage holds some of the layers) draws the same adapters."""
    for name, adapter, weight in adapted_weights(model):
        generator = torch.Generator().manual_seed((seed * 2**32 + zlib.crc32(name.encode())) % 2**63)
        adapter.reset_parameters(weight, generator)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model alone inside the block (DPO's reference, the merged weights' check)."""
    adapters = [adapter for _, adapter, _ in adapted_weights(model)]
    for adapter in adapters:
        adapter.active = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.active = True
