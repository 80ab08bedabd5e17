"""What a checkpoint that could not be written says: its path, why (a full disk named as such), and that the previous
checkpoint is kept. Shared by the file, DCP and background saves."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

FULL_BELOW = 64 << 20  # a disk with less free space than this is taken as the reason a write failed


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written: the message names it, why, and that the previous one is kept."""


def write_failed(path: Path, error: BaseException) -> CheckpointWriteError:
    """The error of a checkpoint that did not write. torch's zip writer reports a full disk as an `unexpected pos`
    RuntimeError rather than ENOSPC, so the free space is looked at too."""
    detail = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"
    free = shutil.disk_usage(path.parent if path.parent.exists() else Path.cwd()).free
    if isinstance(error, OSError) and error.errno == errno.ENOSPC or free < FULL_BELOW:
        detail = f"the disk is full ({free:,} bytes free; {detail})"
    return CheckpointWriteError(
        f"checkpoint {path} was not written: {detail}; the previous checkpoint is kept (ckpt_path=last resumes from it)"
    )
