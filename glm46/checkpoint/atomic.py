"""Checkpoints that a kill cannot break: written under a temporary name and renamed into place, checked
before a resume, and `ckpt_path=last` taking the newest checkpoint that reads.

A process killed while writing leaves `<name>.partial`, which nothing loads (Lightning and the resume
below look only at `*.ckpt`); the previous checkpoint is untouched because the rename is the last step.
Sharded layouts save folders (DCP, DeepSpeed): one counts as complete when its completion marker is
there (`.metadata`, written by DCP after every shard; `latest`, written by DeepSpeed at the end).
One process and DDP also resume from a DCP folder, read whole (a run that continues on fewer devices;
glm46.checkpoint.reshard), and their next `last.ckpt` file replaces the folder of that name.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from glm46.checkpoint.reshard import checkpoint_format, consolidate
from glm46.checkpoint.safe_load import UnsafeCheckpointError, check_safe, load
from glm46.checkpoint.write_errors import write_failed

log = logging.getLogger(__name__)

PARTIAL = ".partial"
FOLDER_MARKERS = (".metadata", "latest")


class CorruptCheckpointError(RuntimeError):
    pass


def _unreadable(path, error: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path}: not a readable checkpoint ({type(error).__name__}: "
        f"{str(error).splitlines()[0][:200] if str(error) else ''})"
    )


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to `<path>.partial`, fsync, then rename onto `path` (atomic on one filesystem). A DCP folder at
    `path` (a mesh layout's last.ckpt, before a resume on one process or DDP) is moved aside to `<path>.old.partial`
    first and removed after the rename; a kill in between leaves the periodic checkpoints."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + PARTIAL)
        try:
            with open(partial, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
        except (OSError, RuntimeError) as error:  # a full disk: ENOSPC, or torch's zip writer's "unexpected pos"
            failure = write_failed(path, error)  # before the partial file goes (the free space)
            partial.unlink(missing_ok=True)
            raise failure from error
        replaced = path.with_name(path.name + ".old" + PARTIAL)
        if path.is_dir():
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(path, replaced)
        os.replace(partial, path)
        shutil.rmtree(replaced, ignore_errors=True)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        """Whatever `weights_only` Lightning asks for, only the allowlist's types (glm46.checkpoint.safe_load)."""
        if checkpoint_format(Path(path)) == "dcp":
            check_safe(path)
            return consolidate(Path(path))
        try:
            return load(path, map_location=map_location)
        except (FileNotFoundError, UnsafeCheckpointError):
            raise
        except Exception as error:  # a truncated zip, a bad pickle, bytes that are not a checkpoint
            raise _unreadable(path, error) from error


def check_readable(path: Path) -> None:
    """Raise CorruptCheckpointError naming `path` unless it is a complete checkpoint, UnsafeCheckpointError if a pickle
    in it asks for more than a checkpoint holds. Files are opened with mmap, which reads the archive's directory and
    the pickled structure, not the tensors' bytes."""
    if path.is_dir():
        if not any((path / marker).exists() for marker in FOLDER_MARKERS):
            raise CorruptCheckpointError(
                f"{path}: a checkpoint folder without its completion marker "
                f"({' or '.join(FOLDER_MARKERS)}): its save did not finish"
            )
        check_safe(path)
        return
    try:
        checkpoint = load(path, map_location="cpu", mmap=True)
    except UnsafeCheckpointError:
        raise
    except Exception as error:
        raise _unreadable(path, error) from error
    if not isinstance(checkpoint, dict) or "global_step" not in checkpoint:
        raise CorruptCheckpointError(f"{path}: not a Lightning checkpoint (no global_step)")


def resume_path(ckpt_path: str | None, directory: Path) -> str | None:
    """The checkpoint a run resumes from. `last`: the newest readable `*.ckpt` in `directory` (last.ckpt
    first, then the periodic ones by modification time); unreadable ones and leftover `.partial` files are
    skipped with a warning naming them; None when there is none (a first run starts fresh). An explicit path
    must be readable."""
    if ckpt_path is None:
        return None
    if ckpt_path != "last":
        check_readable(Path(ckpt_path))
        return ckpt_path
    for partial in sorted(directory.glob(f"*{PARTIAL}")):
        log.warning(f"ignoring {partial}: a checkpoint whose save was interrupted")
    candidates = sorted(
        directory.glob("*.ckpt"), key=lambda p: (p.name == "last.ckpt", p.stat().st_mtime), reverse=True
    )
    for candidate in candidates:
        try:
            check_readable(candidate)
            return str(candidate)
        except CorruptCheckpointError as error:
            log.warning(f"skipping {error}")
    if candidates:
        raise CorruptCheckpointError(
            f"ckpt_path=last: none of the {len(candidates)} checkpoints in {directory} "
            f"is readable ({', '.join(p.name for p in candidates)})"
        )
    log.warning(f"ckpt_path=last: no checkpoint in {directory} yet; starting from the beginning")
    return None
