"""Our state-dict names <-> the Hub's, as pure functions of names and shapes (torchtitan's state-dict adapters:
`to_hf` / `from_hf`), kept apart from reading and writing files (glm46.checkpoint.hf_read, hf_write).

The Hub layout differs from ours in two ways:
- routed experts are stored one matrix per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`);
  we stack them as `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (transformers v5's in-memory layout);
- MTP depth j (0-based) is stored as decoder layer `model.layers.{num_hidden_layers + j}`, with `enorm`,
  `hnorm`, `eh_proj` and `shared_head.norm` beside the decoder-layer weights; GLM-4.5 checkpoints also
  repeat `embed_tokens` and `shared_head.head` there, copies of the shared embedding and lm_head: skipped on
  load and not written, as in GLM-4.6's checkpoints (vLLM and SGLang give the MTP layer the main model's).
"""

from __future__ import annotations

import re

import torch

from glm46.parallel.boxes import Box

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


def from_hf(hub_key: str, num_layers: int) -> tuple[str | None, int | None, str | None]:
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


def hub_region(shape: torch.Size, expert: int | None, part: str | None) -> Box:
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


def to_hf(name: str, shape: torch.Size, num_layers: int):
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
                    box = hub_region(shape, e, part)
                    yield f"{base}{e}.{part}_proj.weight", box, tuple(s.stop - s.start for s in box[1:])
            return
    yield hub, hub_region(shape, None, None), tuple(shape)


def expected_slots(shapes: dict[str, torch.Size]) -> set[tuple[str, int | None, str | None]]:
    """Every (our name, expert, part) that a complete Hub checkpoint fills, for our tensors of `shapes`."""
    slots = set()
    for name, shape in shapes.items():
        if name.endswith(".experts.gate_up_proj"):
            slots |= {(name, e, part) for e in range(shape[0]) for part in ("gate", "up")}
        elif name.endswith(".experts.down_proj"):
            slots |= {(name, e, "down") for e in range(shape[0])}
        else:
            slots.add((name, None, None))
    return slots
