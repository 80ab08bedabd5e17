"""Checkpoint at the next step boundary on SIGTERM or Slurm's warning signal, then stop (and requeue under Slurm).

This callback is the one owner of preemption. submitit's handler and Lightning's SLURM auto-requeue both
save from inside the signal handler, which can run in the middle of a step (after backward, inside the
optimizer step); here the handler only raises a flag, and the checkpoint is written after an optimizer
step has finished, so the resumed run continues exactly. The cluster configs make Slurm send SIGUSR1
(`--signal=USR1@...`) instead of submitit's SIGUSR2, and glm46.app.train turns Lightning's auto-requeue off.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path

import lightning as L

log = logging.getLogger(__name__)


def slurm_job_id() -> str | None:
    """The Slurm job id (`<array job>_<task>` for an array task), as scontrol takes it; None outside Slurm."""
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


class Preemption(L.Callback):
    def __init__(self, signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1"), requeue: bool = True):
        self.signals = [signal.Signals[name] for name in signals]
        self.requeue = requeue
        self.received: signal.Signals | None = None
        self.interrupted_at: int | None = None  # the global step of the checkpoint written on a signal
        self._previous: dict[signal.Signals, object] = {}
        self._last_step = -1
        self._install()  # from construction on: SIGUSR1's default action would kill a job still loading

    def _handle(self, signum: int, frame) -> None:
        """Only note the signal: a second one during the save changes nothing."""
        if self.received is None:
            self.received = signal.Signals(signum)

    def _install(self) -> None:
        for signum in self.signals:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()  # again: Lightning registers its own SIGTERM handler after setup
        self._last_step = trainer.global_step

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._last_step:
            return  # inside a gradient-accumulation cycle: not a step boundary
        self._last_step = trainer.global_step
        if not trainer.strategy.reduce_boolean_decision(self.received is not None, all=False):
            return  # every rank agrees, even if the signal reached only some of them
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        self.interrupted_at = trainer.global_step
        name = self.received.name if self.received else "a signal on another rank"
        log.warning(f"{name}: saved {path} at step {trainer.global_step}; stopping")
        job = slurm_job_id()
        if self.requeue and job and trainer.is_global_zero:
            result = subprocess.run(["scontrol", "requeue", job], check=False, capture_output=True, text=True)
            log.warning(f"scontrol requeue {job}: " + (result.stderr.strip() or "requeued"))
        trainer.should_stop = True

    @staticmethod
    def checkpoint_path(trainer: L.Trainer) -> Path:
        """`last.ckpt` beside the periodic checkpoints, which `ckpt_path=last` resumes from."""
        directory = (
            getattr(trainer.checkpoint_callback, "dirpath", None) or Path(trainer.default_root_dir) / "checkpoints"
        )
        return Path(directory) / "last.ckpt"
