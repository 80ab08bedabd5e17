"""Write a model, whole or sharded over processes, as a transformers/Hub Glm4Moe directory: per-expert keys, MTP
as the last decoder layers, safetensors files with an index, and the config and tokenizer files beside them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from glm46.modules import GLM46ForCausalLM
from glm46.parallel.state import gathered_parts, is_sharded, is_writer, rank_and_world, state_shapes
from glm46.peft.inject import adapted_weights, is_adapter_name

from .hub_config import write_configs
from .hub_files import INDEX_FILE, SINGLE_FILE
from .hub_keys import to_hf
from .safetensors_writer import StreamingSafetensors

if TYPE_CHECKING:
    from glm46.data.tokenizer import GLMTokenizer


def save_hf(
    model: GLM46ForCausalLM,
    path: str | Path,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
    tokenizer: GLMTokenizer | None = None,
) -> Path:
    """Write `model` in the Hub layout (per-expert keys, MTP as the last decoder layers), sharded with an index.

    `transformers.AutoModelForCausalLM.from_pretrained(path)` loads every main-model tensor, and vLLM serves it
    (what it would refuse is logged, glm46.checkpoint.engine_limits). With `tokenizer` (the one the model was trained
    with), its files go beside the weights and the stop ids come from it when the config names none.
    A whole model is written by global rank 0 (other callers return). A model sharded over processes (FSDP2,
    tensor or expert parallel DTensors, DeepSpeed ZeRO-3): every rank must call save_hf. Output file k is
    written by global rank k % world size, one Hub tensor at a time (assembled from the shards that hold
    it, glm46.parallel.boxes.gather_box), so no rank holds more than one Hub tensor beyond its shards;
    global rank 0 writes the index and configs. The folder must be on a filesystem all ranks share.
    """
    if any(adapter.active for _, adapter, _ in adapted_weights(model)):
        raise ValueError("save_hf writes a base model: fold the adapters in first (glm46.peft.merge)")
    path = Path(path)
    if not is_sharded(model) and not is_writer():
        return path  # a whole model is written by global rank 0 alone (it may be the only caller)
    rank, world = rank_and_world() if is_sharded(model) else (0, 1)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    shapes = {name: v for name, v in state_shapes(model).items() if not is_adapter_name(name)}  # merged or off
    dtype = dtype or shapes["lm_head.weight"][1]

    def export_dtype(name: str, own: torch.dtype) -> torch.dtype:
        return own if name.endswith("e_score_correction_bias") else dtype  # kept in fp32, as transformers does

    # Plan the files from sizes alone, then assemble and write one Hub tensor at a time.
    files, size = [[]], 0
    for name, (shape, own) in shapes.items():
        out = export_dtype(name, own)
        for key, box, hub_shape in to_hf(name, shape, config.num_hidden_layers):
            nbytes = math.prod(hub_shape) * out.itemsize
            if files[-1] and size + nbytes > max_shard_bytes:
                files.append([])
                size = 0
            files[-1].append((key, name, box, hub_shape, out))
            size += nbytes
    names = (
        [SINGLE_FILE]
        if len(files) == 1
        else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    )
    requests = [(name, box, i % world) for i, entries in enumerate(files) for _, name, box, _, _ in entries]
    parts = gathered_parts(model, requests)  # collective when the model is sharded
    for i, (file_name, entries) in enumerate(zip(names, files)):
        writer = (
            StreamingSafetensors(path / file_name, [(key, shape, out) for key, _, _, shape, out in entries])
            if i % world == rank
            else None
        )
        for key, _, _, hub_shape, out in entries:
            part = next(parts)
            if writer is not None:
                writer.write(key, part.reshape(hub_shape).to(out))
        if writer is not None:
            writer.close()

    if rank == 0:
        if len(names) > 1:
            weight_map = {key: file_name for file_name, entries in zip(names, files) for key, *_ in entries}
            total = sum(math.prod(shape) * out.itemsize for entries in files for _, _, _, shape, out in entries)
            (path / INDEX_FILE).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        write_configs(config, dtype, path, tokenizer)
    if world > 1:
        torch.distributed.barrier()  # every rank's files are complete when save_hf returns
    return path
