"""The adapters folded into the base: W <- W + s B A (DoRA: m (W + s B A) / ||W + s B A||_row), as peft's
merge_and_unload, leaving a plain GLM46ForCausalLM that every exporter (HF, FP8, GGUF) and engine reads; or for the
length of a block (`merged_weights`: RL's weight pushes to the rollout engine, as slime merges before each sync)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from glm46.modules.experts import GroupedExperts
from glm46.parallel.boxes import local_tensor

from .adapters import LinearAdapter
from .fp8_base import dequantize_base, dequantized_base
from .inject import adapted_weights, adapters_disabled
from .token_rows import TokenRows


@torch.no_grad()
def merge_and_unload(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight (in place, each rank its shards, in the base's dtype), then remove the
    adapters and their hooks; returns the model. The MTP layers, never adapted, are kept as they are. A base stored in
    block FP8 becomes bf16 first (glm46.peft.fp8_base)."""
    dequantize_base(model)
    for _, adapter, weight in list(adapted_weights(model)):
        local = local_tensor(weight)
        local.copy_(adapter.merged_weight(weight).to(local.dtype))
    for module in model.modules():
        adapter = getattr(module, "adapter", None)
        if isinstance(adapter, LinearAdapter):
            adapter.hook.remove()
            del module.adapter
        elif isinstance(adapter, TokenRows):
            del module.adapter  # its `weight` is the base weight again
        elif isinstance(module, GroupedExperts) and adapter is not None:
            module.adapter = None
    return model


@contextmanager
def merged_weights(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block every adapted weight holds its merged value and the adapters are off (the model computes the
    adapted function; save_hf writes it); after it, the base weights are back bit for bit and the adapters on. Holds
    a copy of each adapted weight's shard meanwhile (and of the whole base in bf16, where it is stored in block FP8:
    glm46.peft.fp8_base.dequantized_base)."""
    with dequantized_base(model), _merged(model):
        yield model


@contextmanager
def _merged(model: nn.Module) -> Iterator[None]:
    saved = []
    with torch.no_grad():
        for _, adapter, weight in list(adapted_weights(model)):
            local = local_tensor(weight)
            saved.append((local, local.clone()))
            local.copy_(adapter.merged_weight(weight).to(local.dtype))
    try:
        with adapters_disabled(model):
            yield
    finally:
        with torch.no_grad():
            for local, original in saved:
                local.copy_(original)
