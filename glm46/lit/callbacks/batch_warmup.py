"""Batch-size warm-up by growing gradient accumulation, driven by tokens seen (GLM-4.5: 16M -> 64M tokens
per step over the first 500B tokens)."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L

from glm46.parallel.strategies import data_parallel_size


class BatchSizeWarmup(L.Callback):
    """Sets `trainer.accumulate_grad_batches` to reach the global batch `tokens_per_step(tokens seen)`.

    A change takes effect only where a new accumulation cycle of the new length starts, since
    Lightning steps the optimizer when (batches this epoch) % accumulate_grad_batches == 0;
    every optimizer step therefore sums exactly the micro-batches it claims to.
    """

    def __init__(self, tokens_per_step: Callable[[int], float]):
        self.tokens_per_step = tokens_per_step

    def accumulation_for(self, tokens_seen: int, micro_batch_tokens: int) -> int:
        return max(1, round(self.tokens_per_step(tokens_seen) / micro_batch_tokens))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        done = batch_idx  # batches before this one in this epoch, as Lightning counts them for accumulation
        current = trainer.accumulate_grad_batches
        if done % current:
            return  # inside an accumulation cycle
        micro_batch_tokens = batch["input_ids"].numel() * data_parallel_size(trainer)  # TP ranks share a batch
        wanted = self.accumulation_for(pl_module.tokens_seen, micro_batch_tokens)
        if wanted != current and done % wanted == 0:
            trainer.accumulate_grad_batches = wanted
        pl_module.log("train/accumulate_grad_batches", float(trainer.accumulate_grad_batches))
