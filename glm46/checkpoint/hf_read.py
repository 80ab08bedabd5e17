"""Read a transformers/Hub Glm4Moe directory (config.json + safetensors, sharded or not) into a model that may
itself be sharded over processes: each rank reads from the files only the slices it holds."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from glm46.modules import GLM46ForCausalLM
from glm46.parallel.boxes import intersect, local_box, local_tensor, shift
from glm46.parallel.materialize import ShardedNormal
from glm46.parallel.state import is_sharded
from glm46.peft.inject import base_state_dict

from .fp8 import SCALE_SUFFIX, block_size, dequantize, scale_region
from .hub_config import CheckpointError, config_from_hf
from .hub_files import shard_files
from .hub_keys import expected_slots, from_hf, hub_region

log = logging.getLogger(__name__)


def load_hf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    model: GLM46ForCausalLM | None = None,
) -> GLM46ForCausalLM:
    """A GLM46ForCausalLM with the weights of a transformers/Hub Glm4Moe directory.

    Without `model`, one is built from the directory's config.json (allocated once, on `device` in `dtype`).
    With `model` (whole, or sharded over processes as FSDP2 / tensor / expert parallel DTensors), its
    tensors are filled in place: each rank reads from the safetensors files only the slices it holds.
    Missing MTP weights (transformers writes none) are initialised afresh with a warning; missing or
    misshapen main-model tensors raise CheckpointError listing them.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{config_file} not found")
    hf_config = json.loads(config_file.read_text())
    config = config_from_hf(hf_config)
    block = block_size(hf_config, str(config_file))
    if model is None:
        with torch.device("meta"):
            model = GLM46ForCausalLM(config)
        model.to_empty(device=device).to(dtype)
    with ExitStack() as files:
        handles = {}
        for file in shard_files(path):
            handle = files.enter_context(safe_open(file, framework="pt", device="cpu"))
            handles |= dict.fromkeys(handle.keys(), handle)
        missing = _read_slices(model, handles, path, block)
    if missing:
        log.warning("%s has no (complete) MTP weights; MTP layers are initialised afresh", path)
        if is_sharded(model):
            model.init_weights(model.mtp_layers.modules(), normal_=ShardedNormal(torch.initial_seed()))
        else:
            model.init_weights(model.mtp_layers.modules())
    model.model.rotary_emb.reset_parameters()
    return model


def _read_slices(model: GLM46ForCausalLM, handles: dict, path: Path, block: int | None = None) -> set:
    """Copy into each of the model's tensors the part this rank holds, from the open safetensors `handles`
    (Hub key -> file), dequantizing block-wise FP8 weights (`block`: their block size, glm46.checkpoint.fp8);
    returns the missing MTP slots, raises CheckpointError for anything else missing."""
    state = base_state_dict(model, keep_vars=True)  # parameters, persistent buffers (DTensors stay sharded)
    shapes = {name: tensor.shape for name, tensor in state.items()}  # a DTensor's shape is the global one
    slots_by_name = defaultdict(set)  # a whole stacked tensor (transformers v5 files) fills all its slots
    for slot in expected_slots(shapes):
        slots_by_name[slot[0]].add(slot)

    filled, misshapen, unexpected = set(), [], []
    with torch.no_grad():
        for key, handle in handles.items():
            name, expert, part = from_hf(key, model.config.num_hidden_layers)
            if name is None or (block and key.endswith(SCALE_SUFFIX)):
                continue
            if name not in state:
                unexpected.append(key)
                continue
            region = hub_region(shapes[name], expert, part)
            source = handle.get_slice(key)
            expected = tuple(s.stop - s.start for s in region)[0 if expert is None else 1 :]
            if tuple(source.get_shape()) != expected:
                misshapen.append(f"{key}: checkpoint {tuple(source.get_shape())} vs model {expected}")
                continue
            target, held = local_tensor(state[name]), local_box(state[name])
            common = intersect(held, region)
            scales = key + SCALE_SUFFIX
            if source.get_dtype().startswith("F8") and not (block and scales in handles):
                raise CheckpointError(
                    f"{path}: {key} is FP8 ({source.get_dtype()}) without "
                    + (f"its {scales}" if block else "a quantization_config in config.json")
                )
            if common is not None:
                destination = shift(common, held)
                part_of_source = shift(common, region)[0 if expert is None else 1 :]
                piece = source[part_of_source]
                if block and scales in handles:
                    blocks = handles[scales].get_slice(scales)[scale_region(*part_of_source, block)]
                    piece = dequantize(piece, blocks, *part_of_source, block)
                target[destination] = piece.view(target[destination].shape)
            filled |= slots_by_name[name] if expert is None else {(name, expert, part)}

    missing = set().union(*slots_by_name.values()) - filled
    missing_main = sorted({name for name, _, _ in missing if not name.startswith("mtp_layers.")})
    if missing_main or misshapen:
        raise CheckpointError(
            f"{path} does not fit the model of its config.json:"
            + (f"\n  missing: {missing_main}" if missing_main else "")
            + (f"\n  misshapen: {misshapen}" if misshapen else "")
        )
    if unexpected:
        log.warning("%s: ignored %d tensors the model has no place for: %s", path, len(unexpected), unexpected[:10])
    return missing
