"""A rank stuck in a collective (or anywhere else) is caught: a thread on every rank watches the training steps, and
when none has ended for `factor` x the median step time (at least `min_seconds`; `first_step_seconds` before the
first steps are timed), it writes every thread's stack into `<run dir>/hangs/rank<R>-step<S>.txt` (with torch's
flight recorder of the process group's collectives where the backend keeps one, NCCL), logs one line and ends its
process. Slurm's --kill-on-bad-exit then ends the other ranks and the job's restart (glm46.app.restart) resumes
from the newest checkpoint: a hang costs its bound and a restart, not the process group's timeout."""

from __future__ import annotations

import faulthandler
import logging
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from glm46.errors import ConfigError

log = logging.getLogger(__name__)
EXIT_STATUS = 86  # what a rank ended by the watchdog exits with
LINE = "glm46 watchdog:"  # how its log line starts (glm46.app.restart reads it as the cause)


class HangWatchdog(Callback):
    def __init__(self, factor: float = 10.0, min_seconds: float = 300.0, first_step_seconds: float = 1800.0):
        if not (factor >= 1 and min_seconds > 0 and first_step_seconds > 0):
            raise ConfigError(
                f"callbacks.watchdog: factor={factor} must be >= 1, min_seconds={min_seconds} and "
                f"first_step_seconds={first_step_seconds} > 0"
            )
        self.factor, self.min_seconds, self.first_step_seconds = factor, min_seconds, first_step_seconds
        self.durations: list[float] = []
        self.last_progress = time.monotonic()
        self.step = -1
        self.folder: Path | None = None
        self.rank = 0
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def bound(self) -> float:
        """Seconds without a step after which a rank is taken as hung."""
        if len(self.durations) < 3:
            return self.first_step_seconds
        return max(self.min_seconds, self.factor * statistics.median(self.durations[-100:]))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.folder, self.rank = Path(trainer.default_root_dir) / "hangs", trainer.global_rank
        self.step, self.last_progress = trainer.global_step, time.monotonic()
        self.stop.clear()
        self.thread = threading.Thread(target=self._watch, name="glm46-watchdog", daemon=True)
        self.thread.start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        now = time.monotonic()
        if trainer.global_step != self.step:  # an optimizer step ended (not a micro-batch of one)
            self.durations.append(now - self.last_progress)
            self.step = trainer.global_step
        self.last_progress = now

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        self.last_progress = time.monotonic()  # validation is progress too, as is a checkpoint written

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.last_progress = time.monotonic()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stop.set()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.stop.set()

    def _watch(self) -> None:
        while not self.stop.wait(min(5.0, self.bound() / 10)):
            waited, bound = time.monotonic() - self.last_progress, self.bound()
            if waited > bound:
                self._end(waited, bound)

    def _end(self, waited: float, bound: float) -> None:
        """Dump the stacks (and the flight recorder), say so, and end this process."""
        self.folder.mkdir(parents=True, exist_ok=True)
        dump = self.folder / f"rank{self.rank}-step{self.step}.txt"
        summary = (
            f"rank {self.rank} made no training step for {waited:.0f} s (bound {bound:.0f} s) after step {self.step}"
        )
        with open(dump, "w") as f:
            f.write(f"{summary}\npid {os.getpid()}, {time.strftime('%Y-%m-%dT%H:%M:%S')}; every thread's stack:\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        recorder = _flight_recorder()
        if recorder is not None:
            dump.with_suffix(".flight_recorder.pickle").write_bytes(recorder)
        message = f"{LINE} {summary}: stacks in {dump}; ending this rank"
        log.error(message)
        print(message, file=sys.stderr, flush=True)
        os._exit(EXIT_STATUS)


def _flight_recorder() -> bytes | None:
    """torch's flight recorder of the collectives in flight (NCCL keeps one when TORCH_NCCL_TRACE_BUFFER_SIZE > 0);
    None where the backend keeps none (gloo, or not distributed)."""
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None) if torch.distributed.is_available() else None
    if dump is None or not torch.distributed.is_initialized() or torch.distributed.get_backend() != "nccl":
        return None
    try:
        return dump()
    except RuntimeError:
        return None
