"""Activation checkpointing of the decoder layers (`parallelism.activation_checkpointing` and `..._mode`), as
torchtitan applies it (torchtitan/distributed/activation_checkpoint.py):

    full       each layer keeps its input and is recomputed whole in backward: the least memory, one more forward
    selective  op-level selective checkpointing (torch.utils.checkpoint.create_selective_checkpoint_contexts): the
               outputs of the matmuls (dense, the experts' grouped ones) and of attention are saved, the cheap ops
               between them (norms, RoPE, activations, routing's elementwise ops) recomputed: no matmul runs twice

Both keep the parameters' names (torch's composable checkpoint wraps the layer in place). torchtitan saves every
other dense matmul's output to save more memory; here all are saved, so that backward recomputes no FLOP-heavy op.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from glm46.modules.model import GLM46ForCausalLM, decoder_layers

MODES = ("full", "selective")
aten = torch.ops.aten
SAVED = {  # what selective checkpointing keeps: the ops whose recomputation would cost FLOPs
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._grouped_mm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def checkpointing_mode(enabled: bool, mode: str) -> str | None:
    """parallelism.activation_checkpointing and ..._mode as one value: None (off), "full" or "selective"."""
    if mode not in MODES:
        raise ValueError(f"parallelism.activation_checkpointing_mode={mode}: one of {', '.join(MODES)}")
    return mode if enabled else None


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: GLM46ForCausalLM, mode: str = "full") -> None:
    """Checkpoint every decoder layer (the main model's, then each MTP layer's block) in `mode` (one of MODES)."""
    from torch.distributed._composable import checkpoint

    checkpointing_mode(True, mode)
    options = {"context_fn": partial(create_selective_checkpoint_contexts, _policy)} if mode == "selective" else {}
    for layer in decoder_layers(model):
        checkpoint(layer, **options)
