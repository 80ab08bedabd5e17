"""The Throughput callback times training batches only: validation and checkpoint writes, however slow, leave the
logged tokens/s where the training steps put it."""

import time

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

from glm46.lit.callbacks import Throughput
from glm46.planning.counts import training_flops_per_token

from .helpers import tiny_config

SEQ_LEN, MICRO_BATCH, ACCUMULATE, STEPS, WINDOW = 16, 2, 2, 12, 2
STEP_TOKENS = SEQ_LEN * MICRO_BATCH * ACCUMULATE
TRAIN_SLEEP, SLOW_SLEEP = 0.02, 0.5  # seconds per micro-batch; per validation run and per checkpoint write
PEAK_FLOPS = 1e12


class SleepyModule(L.LightningModule):
    """A steady micro-batch of TRAIN_SLEEP seconds and a validation run that sleeps SLOW_SLEEP."""

    def __init__(self):
        super().__init__()
        self.config = tiny_config()  # what Throughput's MFU reads
        self.layer = torch.nn.Linear(SEQ_LEN, 1)
        self.tokens_seen = 0

    def training_step(self, batch, batch_idx):
        time.sleep(TRAIN_SLEEP)
        self.tokens_seen += batch["input_ids"].numel()
        return self.layer(batch["input_ids"].float()).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        time.sleep(SLOW_SLEEP)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class SlowCheckpointWrite(L.Callback):
    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        time.sleep(SLOW_SLEEP)


class StepWallClock(L.Callback):
    """The old measure: wall-clock seconds between consecutive optimizer steps, everything included."""

    def __init__(self):
        self.seconds, self._last = [], None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._last is None or trainer.global_step != self._last[1]:
            now = time.perf_counter()
            if self._last is not None:
                self.seconds.append(now - self._last[0])
            self._last = (now, trainer.global_step)


class Recorder(Logger):
    """Keeps every logged metrics dict in memory."""

    def __init__(self):
        super().__init__()
        self.rows = []

    name, version = "recorder", 0

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append(dict(metrics))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def test_tokens_per_sec_excludes_validation_and_checkpoint_writes(tmp_path):
    samples = [{"input_ids": torch.randint(0, 100, (SEQ_LEN,))} for _ in range(STEPS * ACCUMULATE * MICRO_BATCH)]
    loader = torch.utils.data.DataLoader(samples, batch_size=MICRO_BATCH)
    wall, recorder = StepWallClock(), Recorder()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        val_check_interval=4 * ACCUMULATE,  # validation every 4 optimizer steps
        limit_val_batches=1,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        callbacks=[checkpoint, Throughput(PEAK_FLOPS, window_size=WINDOW), SlowCheckpointWrite(), wall],
        logger=recorder,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(SleepyModule(), loader, loader)

    logged = [row for row in recorder.rows if "perf/tokens_per_sec" in row]
    rates = [row["perf/tokens_per_sec"] for row in logged]
    assert len(rates) == STEPS, "one value per optimizer step, from the first step on"
    assert max(rates) / min(rates) < 3, rates
    # The sleeps inside the timed span bound the rate from above ...
    assert max(rates) <= STEP_TOKENS / (ACCUMULATE * TRAIN_SLEEP)
    # ... and a window holding one validation run or checkpoint write would be far below every logged value.
    counted = WINDOW * STEP_TOKENS / (WINDOW * ACCUMULATE * TRAIN_SLEEP + SLOW_SLEEP)
    assert min(rates) > 2 * counted, (rates, counted)
    # The run did hold the slow steps: timed from optimizer step to optimizer step they stand out.
    assert len(list(tmp_path.glob("*.ckpt"))) == 4
    assert max(wall.seconds) > SLOW_SLEEP > 3 * min(wall.seconds), wall.seconds

    flops_per_token = training_flops_per_token(tiny_config(), SEQ_LEN)
    for row in logged:
        assert row["perf/mfu"] == pytest.approx(row["perf/tokens_per_sec"] * flops_per_token / PEAK_FLOPS, rel=1e-5)
