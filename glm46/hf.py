"""Import and export of transformers/Hub Glm4Moe checkpoints (config.json + safetensors, sharded or not).

The Hub layout differs from ours in two ways, both handled by renaming here:
- routed experts are stored one matrix per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`);
  we stack them as `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (transformers v5's in-memory layout);
- MTP depth j (0-based) is stored as decoder layer `model.layers.{num_hidden_layers + j}`, with `enorm`,
  `hnorm`, `eh_proj` and `shared_head.norm` beside the decoder-layer weights; GLM-4.5 checkpoints also
  repeat `embed_tokens` and `shared_head.head` there, copies of the shared embedding and lm_head: skipped on
  load and not written, as in GLM-4.6's checkpoints (vLLM and SGLang give the MTP layer the main model's).

An export is a self-contained serving directory: weights, config.json, generation_config.json with GLM's stop
ids, and, given the training tokenizer, tokenizer.json + tokenizer_config.json with the chat template, so
transformers, vLLM and SGLang load it with nothing beside it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from glm46.data.chat import CHAT_TEMPLATE, EOS, STOP_TOKENS
from glm46.modules import GLM46Config, GLM46ForCausalLM
from glm46.serve.compat import serving_problems

if TYPE_CHECKING:
    from glm46.data.tokenizer import GLMTokenizer
    from glm46.parallel.shards import Box

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_MTP_OWN = {  # Hub name inside an MTP layer -> ours inside MTPLayer
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "norm.weight",
}
_MTP_HUB = {ours: hub for hub, ours in _MTP_OWN.items()}
_MTP_DUPLICATES = {"embed_tokens.weight", "shared_head.head.weight"}  # GLM-4.5's copies of the shared tensors


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message lists the tensors."""


# ---------------------------------------------------------------- directories


def find_weights(path: str | Path) -> Path:
    """The HF directory (config.json + safetensors) at `path`: itself, or a run directory's hf/."""
    path = Path(path).absolute()
    for candidate in (path, path / "hf"):
        if (candidate / "config.json").is_file():
            return candidate
    raise FileNotFoundError(
        f"{path} holds no model: neither config.json (an HF directory) nor hf/config.json (a run directory)"
    )


# ---------------------------------------------------------------- config


def config_from_hf(hf: dict) -> GLM46Config:
    """A GLM46Config from a Hub/transformers config.json (old top-level RoPE keys or v5 `rope_parameters`)."""
    if hf.get("model_type") not in (None, "glm4_moe"):
        raise CheckpointError(f"config.json: model_type={hf.get('model_type')!r}, expected 'glm4_moe'")
    rope = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise CheckpointError(f"config.json: rope type {rope_type!r} is not supported (only 'default' RoPE)")
    names = {f.name for f in fields(GLM46Config)}
    values = {k: v for k, v in hf.items() if k in names and v is not None}
    values["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    # transformers defaults partial_rotary_factor to 0.5 for glm4_moe when a config omits it
    values["partial_rotary_factor"] = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    values.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    values.setdefault("num_nextn_predict_layers", hf.get("num_mtp_layers", 0))
    if isinstance(values.get("eos_token_id"), int):
        values["eos_token_id"] = [values["eos_token_id"]]
    values.setdefault("pad_token_id", None)
    values.setdefault("eos_token_id", [])
    return GLM46Config(**values)


def config_to_hf(config: GLM46Config, dtype: torch.dtype) -> dict:
    """Hub-style config.json, readable by transformers, vLLM and SGLang."""
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        **asdict(config),
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# ---------------------------------------------------------------- key mapping


def _ours(hub_key: str, num_layers: int) -> tuple[str | None, int | None, str | None]:
    """Hub key -> (our parameter name or None to skip, expert index, 'gate'|'up'|'down')."""
    name = hub_key
    layer = _LAYER.match(hub_key)
    if layer and int(layer[1]) >= num_layers:  # an MTP layer
        depth, rest = int(layer[1]) - num_layers, layer[2]
        if rest in _MTP_DUPLICATES:
            return None, None, None
        name = f"mtp_layers.{depth}." + (_MTP_OWN[rest] if rest in _MTP_OWN else f"block.{rest}")
    expert = _EXPERT.match(name)
    if expert:
        part = expert[3]
        stacked = "down_proj" if part == "down" else "gate_up_proj"
        return f"{expert[1]}.{stacked}", int(expert[2]), part
    return name, None, None


def _region(shape: torch.Size, expert: int | None, part: str | None) -> Box:
    """The box of one of our tensors (global shape `shape`) that a Hub tensor fills: all of it, or one expert's
    gate, up or down matrix inside a stacked `gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I]."""
    whole = tuple(slice(0, n) for n in shape)
    if expert is None:
        return whole
    rows = whole[1]
    if part == "gate":
        rows = slice(0, shape[1] // 2)
    elif part == "up":
        rows = slice(shape[1] // 2, shape[1])
    return (slice(expert, expert + 1), rows, whole[2])


def _hub_entries(name: str, shape: torch.Size, num_layers: int):
    """Our tensor -> (Hub key, box of ours, Hub shape) for each Hub tensor it is stored as (experts: one per
    expert and part)."""
    mtp = re.match(r"^mtp_layers\.(\d+)\.(.+)$", name)
    hub = name
    if mtp:
        rest = mtp[2]
        hub = f"model.layers.{num_layers + int(mtp[1])}." + _MTP_HUB.get(rest, rest.removeprefix("block."))
    parts = {".experts.gate_up_proj": ("gate", "up"), ".experts.down_proj": ("down",)}
    for suffix, names in parts.items():
        if hub.endswith(suffix):
            base = hub.removesuffix(suffix.removeprefix(".experts."))
            for e in range(shape[0]):
                for part in names:
                    box = _region(shape, e, part)
                    yield f"{base}{e}.{part}_proj.weight", box, tuple(s.stop - s.start for s in box[1:])
            return
    yield hub, _region(shape, None, None), tuple(shape)


def _expected_slots(shapes: dict[str, torch.Size]) -> set[tuple[str, int | None, str | None]]:
    slots = set()
    for name, shape in shapes.items():
        if name.endswith(".experts.gate_up_proj"):
            slots |= {(name, e, part) for e in range(shape[0]) for part in ("gate", "up")}
        elif name.endswith(".experts.down_proj"):
            slots |= {(name, e, "down") for e in range(shape[0])}
        else:
            slots.add((name, None, None))
    return slots


# ---------------------------------------------------------------- load


def _shard_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


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
    config = config_from_hf(json.loads(config_file.read_text()))
    if model is None:
        with torch.device("meta"):
            model = GLM46ForCausalLM(config)
        model.to_empty(device=device).to(dtype)
    with ExitStack() as files:
        handles = {}
        for file in _shard_files(path):
            handle = files.enter_context(safe_open(file, framework="pt", device="cpu"))
            handles |= dict.fromkeys(handle.keys(), handle)
        missing = _read_slices(model, handles, path)
    if missing:
        from glm46.parallel.materialize import ShardedNormal
        from glm46.parallel.state import is_sharded

        log.warning("%s has no (complete) MTP weights; MTP layers are initialised afresh", path)
        if is_sharded(model):
            model.init_weights(model.mtp_layers.modules(), normal_=ShardedNormal(torch.initial_seed()))
        else:
            model.init_weights(model.mtp_layers.modules())
    model.model.rotary_emb.reset_parameters()
    return model


def _read_slices(model: GLM46ForCausalLM, handles: dict, path: Path) -> set:
    """Copy into each of the model's tensors the part this rank holds, from the open safetensors `handles`
    (Hub key -> file); returns the missing MTP slots, raises CheckpointError for anything else missing."""
    from glm46.parallel.shards import intersect, local_box, local_tensor, shift

    state = model.state_dict(keep_vars=True)  # parameters and persistent buffers themselves (DTensors stay sharded)
    shapes = {name: tensor.shape for name, tensor in state.items()}  # a DTensor's shape is the global one
    slots_by_name = defaultdict(set)  # a whole stacked tensor (transformers v5 files) fills all its slots
    for slot in _expected_slots(shapes):
        slots_by_name[slot[0]].add(slot)

    filled, misshapen, unexpected = set(), [], []
    with torch.no_grad():
        for key, handle in handles.items():
            name, expert, part = _ours(key, model.config.num_hidden_layers)
            if name is None:
                continue
            if name not in state:
                unexpected.append(key)
                continue
            region = _region(shapes[name], expert, part)
            source = handle.get_slice(key)
            expected = tuple(s.stop - s.start for s in region)[0 if expert is None else 1 :]
            if tuple(source.get_shape()) != expected:
                misshapen.append(f"{key}: checkpoint {tuple(source.get_shape())} vs model {expected}")
                continue
            target, held = local_tensor(state[name]), local_box(state[name])
            common = intersect(held, region)
            if common is not None:
                destination = shift(common, held)
                piece = source[shift(common, region)[0 if expert is None else 1 :]]
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


# ---------------------------------------------------------------- save


def save_hf(
    model: GLM46ForCausalLM,
    path: str | Path,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
    tokenizer: GLMTokenizer | None = None,
) -> Path:
    """Write `model` in the Hub layout (per-expert keys, MTP as the last decoder layers), sharded with an index.

    `transformers.AutoModelForCausalLM.from_pretrained(path)` loads every main-model tensor, and vLLM serves it
    (what it would refuse is logged, glm46.serve.compat). With `tokenizer` (the one the model was trained
    with), its files go beside the weights and the stop ids come from it when the config names none.
    A whole model is written by global rank 0 (other callers return). A model sharded over processes (FSDP2,
    tensor or expert parallel DTensors, DeepSpeed ZeRO-3): every rank must call save_hf. Output file k is
    written by global rank k % world size, one Hub tensor at a time (assembled from the shards that hold
    it, glm46.parallel.shards.gather_box), so no rank holds more than one Hub tensor beyond its shards;
    global rank 0 writes the index and configs. The folder must be on a filesystem all ranks share.
    """
    from glm46.parallel.state import gathered_parts, is_sharded, is_writer, rank_and_world, state_shapes

    path = Path(path)
    if not is_sharded(model) and not is_writer():
        return path  # a whole model is written by global rank 0 alone (it may be the only caller)
    rank, world = rank_and_world() if is_sharded(model) else (0, 1)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    shapes = state_shapes(model)
    dtype = dtype or shapes["lm_head.weight"][1]

    def export_dtype(name: str, own: torch.dtype) -> torch.dtype:
        return own if name.endswith("e_score_correction_bias") else dtype  # kept in fp32, as transformers does

    # Plan the files from sizes alone, then assemble and write one Hub tensor at a time.
    files, size = [[]], 0
    for name, (shape, own) in shapes.items():
        out = export_dtype(name, own)
        for key, box, hub_shape in _hub_entries(name, shape, config.num_hidden_layers):
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


def special_ids(config: GLM46Config, tokenizer: GLMTokenizer | None) -> tuple[int | None, list[int]]:
    """(pad id, stop ids): the config's, else GLM's (<|endoftext|>, <|user|>, <|observation|>) in `tokenizer`.
    A config whose ids differ from the tokenizer's is logged: an engine would stop at the config's."""
    if tokenizer is None:
        return config.pad_token_id, list(config.eos_token_id)
    stops = [tokenizer.token_id(token) for token in STOP_TOKENS]
    pad = tokenizer.token_id(EOS)
    if config.eos_token_id and sorted(config.eos_token_id) != sorted(stops):
        log.warning(
            "model.eos_token_id=%s differs from the tokenizer's stop tokens %s=%s; the export keeps the config's",
            config.eos_token_id,
            list(STOP_TOKENS),
            stops,
        )
    return (config.pad_token_id, list(config.eos_token_id)) if config.eos_token_id else (pad, stops)


def write_configs(config: GLM46Config, dtype: torch.dtype, path: Path, tokenizer: GLMTokenizer | None) -> None:
    """config.json, generation_config.json and (with `tokenizer`) tokenizer.json + tokenizer_config.json."""
    pad, stops = special_ids(config, tokenizer)
    hub = config_to_hf(config, dtype) | {"pad_token_id": pad, "eos_token_id": stops}
    (path / "config.json").write_text(json.dumps(hub, indent=2))
    generation = {"_from_model_config": True, "pad_token_id": pad, "eos_token_id": stops}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if tokenizer is not None:
        tokenizer.save(path / "tokenizer.json")
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(config), indent=2))
    for problem in serving_problems(config):
        log.warning("%s: %s", path, problem)


def tokenizer_config(config: GLM46Config) -> dict:
    """tokenizer_config.json for transformers' fast tokenizer over our tokenizer.json, as GLM-4.6's names its
    special tokens (pad = eos = <|endoftext|>, left padding), with our chat template (glm46.data.chat)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }


_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class StreamingSafetensors:
    """A .safetensors file written tensor by tensor: the header (every key's dtype, shape and offsets) is known
    in advance, so each tensor's bytes go to disk as it arrives and memory never holds the whole file."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]]):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, shape, dtype in entries:
            nbytes = math.prod(shape) * dtype.itemsize
            header[key] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self.expected = [key for key, _, _ in entries]
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if not self.expected or self.expected[0] != key:
            raise RuntimeError(f"{self.file.name}: got {key}, expected {self.expected[:1]}")
        self.expected.pop(0)
        self.file.write(tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        if self.expected:
            raise RuntimeError(
                f"{self.file.name}: {len(self.expected)} tensors never written, first {self.expected[0]}"
            )
        self.file.close()
