"""Tokens per second and model FLOP utilisation (MFU) over a sliding window of optimizer steps, timing only the
training batches: a step that also ran validation or wrote a checkpoint must not make the curve jump.

Only the time from `on_train_batch_start` to `on_train_batch_end` counts (as in Lightning's ThroughputMonitor,
which keeps a window too). Lightning runs callbacks in `trainer.callbacks` order, and
`_CallbackConnector._reorder_callbacks` (lightning/pytorch/trainer/connectors/callback_connector.py) moves every
Checkpoint callback to the end, so ModelCheckpoint's `on_train_batch_end` save runs after this callback's; and
`_TrainingEpochLoop.on_advance_end` (lightning/pytorch/loops/training_epoch_loop.py) runs validation after
`on_train_batch_end`, and ModelCheckpoint's `on_validation_end` save with it. Both fall outside the timed span;
so does waiting for the next batch from the data loader.
"""

from __future__ import annotations

import time
from collections import deque

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops

from glm46.planning.counts import training_flops_per_token


def measured_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 4) -> float:
    """The FLOP/s this device reaches on a square matmul: the peak MFU is measured against where no
    datasheet figure is known (CPUs)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def _now(device: torch.device) -> float:
    """The host clock once the device's queued work is done, or the GPU's time would leak across the boundary."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Throughput(L.Callback):
    """Logs `perf/tokens_per_sec` (over all data-parallel ranks, from `pl_module.tokens_seen`) and `perf/mfu` at
    every optimizer step, averaged over the last `window_size` steps."""

    def __init__(self, peak_flops: float | None = None, window_size: int = 10):
        if window_size < 1:
            raise ValueError(f"Throughput window_size must be at least 1 step, got {window_size}")
        self.peak_flops = peak_flops
        self.flops_per_token = 0.0
        self.window: deque[tuple[float, int]] = deque(maxlen=window_size)  # per optimizer step: (seconds, tokens)
        self._batch_start = 0.0
        self._step_seconds = 0.0  # training time of the optimizer step being accumulated
        self._last: tuple[int, int] = (0, 0)  # (global step, tokens seen) at the last step boundary

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.peak_flops is None:
            dtype = torch.bfloat16 if "bf16" in str(trainer.precision) else torch.float32
            self.peak_flops = get_available_flops(pl_module.device, dtype) or measured_matmul_flops(
                pl_module.device, dtype
            )
        self.window.clear()
        self._step_seconds = 0.0
        self._last = (trainer.global_step, pl_module.tokens_seen)  # after a resume, tokens_seen is restored

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        self._batch_start = _now(pl_module.device)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if "input_ids" not in batch:
            return  # prompts: an RL step (glm46.rl.grpo_module) logs its rollout and update rates itself
        self._step_seconds += _now(pl_module.device) - self._batch_start
        if trainer.global_step == self._last[0]:
            return  # still accumulating
        self.window.append((self._step_seconds, pl_module.tokens_seen - self._last[1]))
        self._step_seconds = 0.0
        self._last = (trainer.global_step, pl_module.tokens_seen)
        if not self.flops_per_token:
            self.flops_per_token = training_flops_per_token(pl_module.config, batch["input_ids"].shape[1])
        tokens_per_sec = sum(tokens for _, tokens in self.window) / sum(seconds for seconds, _ in self.window)
        pl_module.log("perf/tokens_per_sec", tokens_per_sec, prog_bar=True)
        pl_module.log("perf/mfu", tokens_per_sec * self.flops_per_token / self.peak_flops / trainer.world_size)
