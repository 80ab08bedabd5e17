"""Checkpoints that do not stall training (`parallelism.async_checkpoint`): a mesh layout's DCP folder is staged
into host memory on the training thread and written by a background thread (torch.distributed.checkpoint.async_save,
as torchtitan's async mode) while the next steps run. One save is in flight at a time: the next save, and the end
of training, wait for it, and a failure of the write (a full disk) surfaces there, naming the folder; the folder
counts as a checkpoint only once DCP's `.metadata` is written, last, so the previous checkpoint stays the one a
resume takes (glm46.checkpoint.atomic)."""

from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from glm46.checkpoint.write_errors import write_failed

log = logging.getLogger(__name__)


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
            failure = write_failed(path, error)  # before the folder goes: the free space tells a full disk
            if not dist.is_initialized() or dist.get_rank() == 0:
                shutil.rmtree(path, ignore_errors=True)
            raise failure from error
        log.info(f"checkpoint {path} written in the background ({time.monotonic() - started:.1f} s)")
