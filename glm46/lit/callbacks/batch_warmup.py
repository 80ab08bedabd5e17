"""Batch-size warm-up by growing gradient accumulation, driven by the recipe's tokens (GLM-4.5: 16M -> 64M tokens
per step over the first 500B tokens of pre-training)."""

from __future__ import annotations

import lightning as L

from glm46.optim.schedules import LinearRamp, accumulation_for, next_accumulation
from glm46.parallel.data_parallel import data_parallel_size


class BatchSizeWarmup(L.Callback):
    """Sets `trainer.accumulate_grad_batches` to reach the global batch `tokens_per_step(recipe tokens)`, where the
    recipe's tokens are `pl_module.recipe_tokens` (the phase's start on the clock plus its tokens seen).

    A change takes effect only where a new accumulation cycle of the new length starts
    (glm46.optim.schedules.next_accumulation), so every optimizer step sums exactly the micro-batches it claims;
    `trainer.max_steps` of the production experiments counts the same steps (glm46.optim.schedules.steps_for).
    """

    owns_accumulation = True  # a resume takes the checkpoint's accumulation (glm46.checkpoint.training_state)

    def __init__(self, tokens_per_step: LinearRamp):
        self.tokens_per_step = tokens_per_step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        done = batch_idx  # batches before this one in this epoch, as Lightning counts them for accumulation
        current = trainer.accumulate_grad_batches
        if done % current:
            return  # inside an accumulation cycle
        micro_batch_tokens = batch["input_ids"].numel() * data_parallel_size(trainer)  # TP ranks share a batch
        wanted = accumulation_for(self.tokens_per_step, pl_module.recipe_tokens, micro_batch_tokens)
        trainer.accumulate_grad_batches = next_accumulation(done, current, wanted)
        pl_module.log("train/accumulate_grad_batches", float(trainer.accumulate_grad_batches))
