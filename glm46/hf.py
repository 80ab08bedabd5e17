"""Import and export of transformers/Hub Glm4Moe checkpoints (config.json + safetensors, sharded or not).

The Hub layout differs from ours in two ways, both handled by renaming here:
- routed experts are stored one matrix per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`);
  we stack them as `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (transformers v5's in-memory layout);
- MTP depth j (0-based) is stored as decoder layer `model.layers.{num_hidden_layers + j}`, with `enorm`,
  `hnorm`, `eh_proj` and `shared_head.norm` beside the decoder-layer weights; GLM-4.5 checkpoints also
  repeat `embed_tokens` and `shared_head.head` there, copies of the shared embedding and lm_head.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from dataclasses import asdict, fields
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glm46.modules import GLM46Config, GLM46ForCausalLM

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
_MTP_DUPLICATES = {"embed_tokens.weight", "shared_head.head.weight"}  # shared with the main model


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message lists the tensors."""


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


def _hub_items(name: str, tensor: torch.Tensor, num_layers: int):
    """Our (name, tensor) -> Hub (key, tensor) pairs, splitting stacked experts per expert."""
    mtp = re.match(r"^mtp_layers\.(\d+)\.(.+)$", name)
    if mtp:
        prefix = f"model.layers.{num_layers + int(mtp[1])}."
        rest = mtp[2]
        name = prefix + _MTP_HUB.get(rest, rest.removeprefix("block."))
    if name.endswith(".experts.gate_up_proj"):
        base = name.removesuffix("gate_up_proj")
        for e, weight in enumerate(tensor):
            gate, up = weight.chunk(2, dim=0)
            yield f"{base}{e}.gate_proj.weight", gate
            yield f"{base}{e}.up_proj.weight", up
    elif name.endswith(".experts.down_proj"):
        base = name.removesuffix("down_proj")
        for e, weight in enumerate(tensor):
            yield f"{base}{e}.down_proj.weight", weight
    else:
        yield name, tensor


def _slot(target: torch.Tensor, expert: int | None, part: str | None) -> torch.Tensor:
    """The view of one of our tensors that a Hub tensor fills."""
    if expert is None:
        return target
    if part == "down":
        return target[expert]
    gate, up = target[expert].chunk(2, dim=0)
    return gate if part == "gate" else up


def _expected_slots(state: dict[str, torch.Tensor]) -> set[tuple[str, int | None, str | None]]:
    slots = set()
    for name, tensor in state.items():
        if name.endswith(".experts.gate_up_proj"):
            slots |= {(name, e, part) for e in range(tensor.shape[0]) for part in ("gate", "up")}
        elif name.endswith(".experts.down_proj"):
            slots |= {(name, e, "down") for e in range(tensor.shape[0])}
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


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> GLM46ForCausalLM:
    """Build a GLM46ForCausalLM from a transformers/Hub Glm4Moe directory.

    Tensors are copied shard by shard into a model allocated once, so memory never holds the
    checkpoint twice. Missing MTP weights (transformers writes none) are initialised afresh with a
    warning; missing or misshapen main-model tensors raise CheckpointError listing them.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{config_file} not found")
    config = config_from_hf(json.loads(config_file.read_text()))
    with torch.device("meta"):
        model = GLM46ForCausalLM(config)
    model.to_empty(device=device).to(dtype)
    state = model.state_dict()
    expected = _expected_slots(state)
    slots_by_name = defaultdict(set)  # a whole stacked tensor (transformers v5 files) fills all its slots
    for slot in expected:
        slots_by_name[slot[0]].add(slot)

    filled, misshapen, unexpected = set(), [], []
    for file in _shard_files(path):
        with safe_open(file, framework="pt", device=str(device)) as shard:
            for key in shard.keys():
                name, expert, part = _ours(key, config.num_hidden_layers)
                if name is None:
                    continue
                if name not in state:
                    unexpected.append(key)
                    continue
                target = _slot(state[name], expert, part)
                tensor = shard.get_tensor(key)
                if tensor.shape != target.shape:
                    misshapen.append(f"{key}: checkpoint {tuple(tensor.shape)} vs model {tuple(target.shape)}")
                    continue
                with torch.no_grad():
                    target.copy_(tensor)
                filled |= slots_by_name[name] if expert is None else {(name, expert, part)}

    missing = expected - filled
    missing_main = sorted({name for name, _, _ in missing if not name.startswith("mtp_layers.")})
    if missing_main or misshapen:
        raise CheckpointError(
            f"{path} does not fit the model of its config.json:"
            + (f"\n  missing: {missing_main}" if missing_main else "")
            + (f"\n  misshapen: {misshapen}" if misshapen else "")
        )
    if unexpected:
        log.warning("%s: ignored %d tensors the model has no place for: %s", path, len(unexpected), unexpected[:10])
    if missing:
        log.warning("%s has no (complete) MTP weights; MTP layers are initialised afresh", path)
        model.init_weights(model.mtp_layers.modules())
    model.model.rotary_emb.reset_parameters()
    return model


# ---------------------------------------------------------------- save


def save_hf(
    model: GLM46ForCausalLM, path: str | Path, max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None
) -> Path:
    """Write `model` in the Hub layout (per-expert keys, MTP as the last decoder layers), sharded with an index.

    `transformers.AutoModelForCausalLM.from_pretrained(path)` loads every main-model tensor.
    A model sharded over processes (FSDP2, tensor or expert parallel DTensors, DeepSpeed ZeRO-3) is
    gathered one tensor at a time: then every rank must call save_hf, and global rank 0 writes.
    """
    from glm46.parallel.state import full_state_items, is_writer, state_shapes

    path = Path(path)
    writer = is_writer()
    if writer:
        path.mkdir(parents=True, exist_ok=True)
    config = model.config
    shapes = state_shapes(model)
    dtype = dtype or shapes["lm_head.weight"][1]

    def hub_tensors(items):
        for name, tensor in items:
            if not name.endswith("e_score_correction_bias"):  # kept in fp32, as transformers does
                tensor = tensor.to(dtype)
            for key, hub_tensor in _hub_items(name, tensor, config.num_hidden_layers):
                yield key, hub_tensor

    # Plan the shards from sizes alone (meta tensors), then gather and write one shard at a time.
    meta = ((name, torch.empty(shape, dtype=dt, device="meta")) for name, (shape, dt) in shapes.items())
    shards, size = [[]], 0
    for key, tensor in hub_tensors(meta):
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    weight_map = {key: name for name, keys in zip(names, shards) for key in keys}

    shard_of = iter(names)
    current, pending, total = next(shard_of), {}, 0
    for key, tensor in hub_tensors(full_state_items(model)):  # collective when the model is sharded
        if not writer:
            continue
        if weight_map[key] != current:
            save_file(pending, path / current, metadata={"format": "pt"})
            current, pending = next(shard_of), {}
        pending[key] = tensor.detach().to("cpu").clone().contiguous()
        total += tensor.numel() * tensor.element_size()
    if not writer:
        return path
    save_file(pending, path / current, metadata={"format": "pt"})

    if len(names) > 1:
        (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(config_to_hf(config, dtype), indent=2))
    generation = {"pad_token_id": config.pad_token_id, "eos_token_id": config.eos_token_id}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path
