"""Checkpoints that do not stall training (`parallelism.async_checkpoint`): a mesh layout's DCP folder is staged
into host memory on the training thread and written by a background thread (torch.distributed.checkpoint.async_save,
as torchtitan's async mode) while the next steps run. One save is in flight at a time: the next save, and the end
of training, wait for it, and a failure of the write (a full disk) surfaces there, naming the folder; the folder
counts as a checkpoint only once DCP's `.metadata` is written, last, so the previous checkpoint stays the one a
resume takes (glm46.checkpoint.atomic)."""

from __future__ import annotations

import errno
import logging
import shutil
import time
from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

log = logging.getLogger(__name__)
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


class BackgroundCheckpointWriter:
    def __init__(self) -> None:
        self.pending: tuple[Future, Path, float] | None = None
        self.group: dist.ProcessGroup | None = None

    def save(self, state: dict, path: Path) -> None:
        """Stage `state` (copies into host memory, on this thread) and start writing it to `path`."""
        self.wait()
        if self.group is None and dist.is_initialized():  # the writer's collectives run beside training's: gloo
            self.group = dist.new_group(backend="gloo")
        self.pending = (dcp.async_save(state, checkpoint_id=path, process_group=self.group), path, time.monotonic())

    def wait(self) -> None:
        """Block until the save in flight is written; a failed write removes its folder and raises."""
        if self.pending is None:
            return
        future, path, started = self.pending
        self.pending = None
        try:
            future.result()
        except BaseException as error:  # DCP's CheckpointException is a BaseException wrapping each rank's error
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise
            if not dist.is_initialized() or dist.get_rank() == 0:
                shutil.rmtree(path, ignore_errors=True)
            raise write_failed(path, error) from error
        log.info(f"checkpoint {path} written in the background ({time.monotonic() - started:.1f} s)")
