"""Progress that reads well on a terminal and in a file: Lightning's tqdm bars on a terminal; where stdout is a file
or a pipe (a Slurm log, CI), whose carriage-return redraws would pile up into one unreadable line, one log line
every `refresh_rate` optimizer steps instead: step, the progress-bar metrics, elapsed time and the time left."""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

from glm46.logs import rank_zero_logger

log = rank_zero_logger(__name__)


def duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class Progress(TQDMProgressBar):
    def __init__(
        self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False, lines: bool | None = None
    ):
        """lines: one line per `refresh_rate` steps instead of bars; None: when stdout is not a terminal."""
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self.lines = not sys.stdout.isatty() if lines is None else lines
        self._start: tuple[float, int] | None = None  # (time, global step) when training (re)started
        self._last_step = -1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.lines:
            self.disable()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start = (time.monotonic(), trainer.global_step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        step = trainer.global_step
        if not self.lines or step == self._last_step or self._start is None:
            return  # a micro-batch of an accumulated step, or bars
        self._last_step = step
        if step % self.refresh_rate == 0 or step == trainer.max_steps:
            log.info(self.line(step, trainer.max_steps, self.get_metrics(trainer, pl_module)))

    def line(self, step: int, max_steps: int, metrics: dict) -> str:
        started, first = self._start
        elapsed = time.monotonic() - started
        parts = [f"step {step}/{max_steps} ({100 * step / max_steps:.0f}%)" if max_steps > 0 else f"step {step}"]
        parts += [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items() if k != "v_num"]
        parts.append(f"elapsed {duration(elapsed)}")
        if max_steps > 0 and step > first:
            parts.append(f"left {duration(elapsed / (step - first) * (max_steps - step))}")
        return " | ".join(parts)
