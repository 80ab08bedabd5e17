"""Tokens per second and model FLOP utilisation (MFU), measured between optimizer steps."""

from __future__ import annotations

import time

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops

from glm46.estimate import training_flops_per_token


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


class Throughput(L.Callback):
    def __init__(self, peak_flops: float | None = None):
        self.peak_flops = peak_flops
        self.flops_per_token = 0.0
        self._last: tuple[float, int, int] | None = None  # (time, tokens seen, global step)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.peak_flops is None:
            dtype = torch.bfloat16 if "bf16" in str(trainer.precision) else torch.float32
            self.peak_flops = get_available_flops(pl_module.device, dtype) or measured_matmul_flops(
                pl_module.device, dtype
            )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        now, step = time.perf_counter(), trainer.global_step
        if self._last is not None and step == self._last[2]:
            return  # still accumulating
        if self._last is not None:
            if not self.flops_per_token:
                self.flops_per_token = training_flops_per_token(pl_module.config, batch["input_ids"].shape[1])
            tokens_per_sec = (pl_module.tokens_seen - self._last[1]) / (now - self._last[0])
            pl_module.log("perf/tokens_per_sec", tokens_per_sec, prog_bar=True)
            pl_module.log("perf/mfu", tokens_per_sec * self.flops_per_token / self.peak_flops / trainer.world_size)
        self._last = (now, pl_module.tokens_seen, step)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = None  # do not count evaluation time as training time
