"""torch.compile of each decoder layer, in place (`module.compile`), as torchtitan's apply_compile does.

Each layer's own forward is compiled (`nn.Module.compile`), so the state-dict keys, the pipeline split, the
checkpoints and the HF export see the module they always did. It runs after the layout (TP, EP, activation
checkpointing, FSDP2): FSDP2's hooks are excluded from Dynamo (torch marks them so) and run eagerly around the
compiled layer, and activation checkpointing's hooks wrap it (tests/test_compile.py). Identical layers share one
graph (Dynamo inlines the modules and takes their weights as inputs), so a model compiles one dense and one MoE layer,
forward and backward; packed documents' attention runs between the graphs (glm46.modules.attention.packed_attention),
so a batch of other documents does not recompile. The number of graphs Dynamo has compiled is logged
(`compile/graphs`): after the first steps it stays put, and a rise is a recompile.
"""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from glm46.modules import GLM46ForCausalLM
from glm46.modules.model import decoder_layers


def compile_decoder_layers(model: GLM46ForCausalLM, backend: str = "inductor") -> None:
    """Compile every decoder layer (the MTP layers' too) in place. The MoE's per-expert row counts are tensors of a
    fixed size; the grouped matmul reads them on the device, so no step reads a value on the host."""
    # the per-expert loop (CUDA in fp32: the grouped matmul takes bf16 only there) reads its counts on the host
    torch._dynamo.config.capture_scalar_outputs = True
    for layer in decoder_layers(model):
        layer.compile(backend=backend)


def compiled_graphs() -> int:
    """Frames Dynamo has compiled in this process: the first compile of each graph plus every recompile."""
    return counters["frames"]["ok"]
