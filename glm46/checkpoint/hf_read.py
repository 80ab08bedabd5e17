"""Read a transformers/Hub Glm4Moe directory (config.json + safetensors, sharded or not) into a model that may
itself be sharded over processes: each rank reads from the files only the slices it holds."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from glm46.modules import GLM46ForCausalLM
from glm46.modules.experts import part_rows
from glm46.parallel.boxes import intersect, local_box, local_tensor, shift
from glm46.parallel.materialize import ShardedNormal
from glm46.parallel.state import is_sharded
from glm46.peft.inject import base_state_dict

from .fp8 import SCALE_SUFFIX, block_size, dequantize, quantize, scale_region
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
    (Hub key -> file), dequantizing block-wise FP8 weights (`block`: their block size, glm46.checkpoint.fp8), or
    keeping them in FP8 where the model stores its base so (glm46.peft.fp8_base); returns the missing MTP slots,
    raises CheckpointError for anything else missing."""
    state = base_state_dict(model, keep_vars=True)  # parameters, persistent buffers (DTensors stay sharded)
    scales = {name: state.pop(name) for name in [n for n in state if n.endswith(SCALE_SUFFIX)]}  # an FP8 base's
    shapes = {name: tensor.shape for name, tensor in state.items()}  # a DTensor's shape is the global one
    slots_by_name = defaultdict(set)  # a whole stacked tensor (transformers v5 files) fills all its slots
    for slot in expected_slots(shapes):
        slots_by_name[slot[0]].add(slot)

    filled, misshapen, unexpected = set(), [], []
    with torch.no_grad():
        for scale_inv in scales.values():
            scale_inv.zero_()  # filled where this rank holds the weights, then gathered (_share_fp8_scales)
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
            scales_key = key + SCALE_SUFFIX
            source_scales = handles[scales_key].get_slice(scales_key) if block and scales_key in handles else None
            if source.get_dtype().startswith("F8") and source_scales is None:
                raise CheckpointError(
                    f"{path}: {key} is FP8 ({source.get_dtype()}) without "
                    + (f"its {scales_key}" if block else "a quantization_config in config.json")
                )
            if common is not None and name + SCALE_SUFFIX in scales:
                fp8 = _Fp8Slot(model, name, region, 0 if expert is None else 1, path)
                fp8.read(source, source_scales, block, target[shift(common, held)], shift(common, region))
                fp8.write_scales(scales[name + SCALE_SUFFIX])
            elif common is not None:
                destination = shift(common, held)
                part_of_source = shift(common, region)[0 if expert is None else 1 :]
                piece = source[part_of_source]
                if source_scales is not None:
                    blocks = source_scales[scale_region(*part_of_source, block)]
                    piece = dequantize(piece, blocks, *part_of_source, block)
                target[destination] = piece.view(target[destination].shape)
            filled |= slots_by_name[name] if expert is None else {(name, expert, part)}
        _share_fp8_scales(state, scales)

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


class _Fp8Slot:
    """One Hub tensor read into a weight that the model stores in block FP8 (a PEFT run's base: glm46.peft.fp8_base):
    its values bit for bit and its scales from a block-FP8 checkpoint of the model's block, or quantized from a
    bf16 one (the whole Hub tensor read, so that the blocks astride this rank's part are those of the whole)."""

    def __init__(self, model: GLM46ForCausalLM, name: str, region: tuple, first: int, path: Path):
        module_name, _, self.weight_name = name.rpartition(".")
        self.block = model.get_submodule(module_name).fp8_block
        self.region, self.first, self.path, self.name = region, first, path, name  # first: the Hub tensor's dims
        self.part_rows = None if first else part_rows(self.weight_name, region[-2].stop)  # stacked: in parts
        self.scales: torch.Tensor | None = None

    def read(self, source, source_scales, block: int | None, destination: torch.Tensor, part: tuple) -> None:
        """Fill `destination` (this rank's part, at `part` of the Hub tensor's region) and keep the tensor's scales."""
        if source_scales is not None:
            if block != self.block:
                raise CheckpointError(
                    f"{self.path}: FP8 blocks of {block} for {self.name}, whose model stores blocks of {self.block}"
                )
            values, self.scales = source[part[self.first :]], source_scales[:]
        else:
            values, self.scales = quantize(source[:], self.block, self.part_rows)
            values = values[part[self.first :]]
        destination.copy_(values.view(destination.shape))

    def write_scales(self, scale_inv: torch.Tensor) -> None:
        """Put the tensor's scales at their blocks of the weight's `scale_inv` (whole on every rank)."""
        *lead, rows, _ = self.region
        if self.first:  # one expert's gate, up or down matrix: its part of the expert's stacked rows
            part_blocks = self.scales.shape[-2]
            start = rows.start // (rows.stop - rows.start) * part_blocks
            scale_inv[lead[0], start : start + part_blocks] = self.scales
        else:
            scale_inv.copy_(self.scales.view(scale_inv.shape))


def _share_fp8_scales(state: dict, scales: dict) -> None:
    """Each rank filled the scales of the weights it holds: the largest over the ranks sharing a weight is every
    rank's (the others hold zeros there). Collective over a sharded weight's mesh."""
    for name, scale_inv in scales.items():
        weight = state[name.removesuffix(SCALE_SUFFIX)]
        mesh = getattr(weight, "device_mesh", None)
        for dim in range(mesh.ndim if mesh is not None else 0):
            dist.all_reduce(scale_inv, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
