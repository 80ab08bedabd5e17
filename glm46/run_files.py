"""The two files that let `python -m glm46.compare` read runs and sweeps (written by glm46.app.sweep and the Slurm
launcher, read by glm46.reports.sweep_summary):

- `<run dir>/state.json`: {"state": running | completed | failed | interrupted, "pid", "host", "job_id", "started",
  "ended", "error"};
- `<sweep dir>/sweep.json`: {"members": [{"dir", "overrides", "job_id"}]}, every member a sweep will run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
SWEEP_FILE = "sweep.json"


def is_run_dir(path: Path) -> bool:
    """A run directory: Hydra saved the composition it ran with there."""
    return (path / ".hydra" / "config.yaml").is_file()


def write_json(path: Path, value: Any) -> None:
    """Whole or not at all: a reader never sees half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value, indent=2))
    os.replace(partial, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_manifest(sweep_dir: Path, members: list[dict]) -> Path:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path = sweep_dir / SWEEP_FILE
    write_json(path, {"members": members})
    return path
