"""Where a Hub directory's weights are: the directory itself or a run's hf/, and its safetensors files."""

from __future__ import annotations

import json
from pathlib import Path

from .hub_config import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def find_weights(path: str | Path) -> Path:
    """The HF directory (config.json + safetensors) at `path`: itself, or a run directory's hf/."""
    path = Path(path).absolute()
    for candidate in (path, path / "hf"):
        if (candidate / "config.json").is_file():
            return candidate
    raise FileNotFoundError(
        f"{path} holds no model: neither config.json (an HF directory) nor hf/config.json (a run directory)"
    )


def weights_folder(init_from: str | Path | None) -> Path | None:
    """The HF folder (config.json beside the weights) of `init_from`: an HF directory, a run directory's hf/, or the
    hf/ of the run a `<run>/checkpoints/*.ckpt` belongs to; None where there is none (yet)."""
    if not init_from:
        return None
    path = Path(init_from)
    try:
        return find_weights(
            path.parent.parent if path.suffix == ".ckpt" and path.parent.name == "checkpoints" else path
        )
    except FileNotFoundError:
        return None


def shard_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
