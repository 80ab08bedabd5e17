"""Checkpoints crafted to run code when unpickled: each writes a marker file through `os.system` (the global
`posix.system`), so a test sees whether anything unpickled it without limits."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp


class WritesMarker:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def unsafe_checkpoint(path: Path, marker: Path) -> Path:
    """A Lightning-shaped `.ckpt` (global_step, state_dict) with the payload beside the weights."""
    torch.save({"global_step": 1, "state_dict": {"model.w": torch.zeros(2)}, "extra": WritesMarker(marker)}, path)
    return path


def unsafe_dcp_folder(folder: Path, marker: Path) -> Path:
    """A DCP folder whose non-tensor item is the payload: DCP stores it as a torch.save blob inside a `.distcp`
    file and reads it back with `weights_only=False`."""
    state = {"state_dict": {"model.w": torch.zeros(2)}, "evil": WritesMarker(marker)}
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    return folder
