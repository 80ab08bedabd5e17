"""Batch-size warm-up grows gradient accumulation with tokens seen, and every step sums what it claims."""

import lightning as L
import torch
from torch.utils.data import DataLoader

from glm46.lit import TokenWindows
from glm46.lit.callbacks import BatchSizeWarmup
from glm46.optim import LinearRamp

from .helpers import tiny_config
from .test_balancer import lit_module


class CountMicroBatches(L.Callback):
    def __init__(self):
        self.backwards, self.steps = 0, []  # (micro-batches summed, accumulate_grad_batches) per step

    def on_after_backward(self, trainer, pl_module):
        self.backwards += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append((self.backwards, trainer.accumulate_grad_batches))
        self.backwards = 0


def test_accumulation_grows_from_1_to_4_micro_batches_and_steps_stay_whole():
    config = tiny_config()
    micro_batch_tokens = 2 * 16
    ramp = LinearRamp(start=micro_batch_tokens, end=4 * micro_batch_tokens, ramp_tokens=20 * micro_batch_tokens)
    tokens = torch.randint(0, config.vocab_size, (50_000,)).numpy()
    loader = DataLoader(TokenWindows(tokens, seq_len=16), batch_size=2)
    counter = CountMicroBatches()
    trainer = L.Trainer(
        max_steps=20,
        callbacks=[BatchSizeWarmup(ramp), counter],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(lit_module(config), train_dataloaders=loader)

    assert all(summed == claimed for summed, claimed in counter.steps), counter.steps
    sizes = [claimed for _, claimed in counter.steps]
    assert sizes == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 8  # a change waits for a whole cycle of its length
