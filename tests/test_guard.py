"""The step guard: a bad step (non-finite loss or gradient, or a loss spike) changes no weight, optimizer
state or balancer bias; bad steps in a row roll the weights and optimizer back to the newest checkpoint and
training goes on with the batches after the bad ones; `on_repeated: stop` stops with a message."""

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from glm46.checkpoint.atomic import AtomicCheckpointIO
from glm46.data.windows import MixtureWindows
from glm46.lit.callbacks import ExpertBalancer, ModelCheckpoint
from glm46.lit.guard import StepGuard, TrainingDiverged
from glm46.optim import Piecewise

from .helpers import tiny_config
from .test_balancer import lit_module


def test_judge_names_the_reason_and_keeps_bad_losses_out_of_the_average():
    guard = StepGuard(spike_factor=3.0, warmup_steps=2, ema_decay=0.5, max_bad_steps=2)
    assert guard.judge(4.0, 1.0) is None  # the first good step sets the average
    assert guard.judge(2.0, 1.0) is None and guard.running_loss == 3.0
    assert guard.judge(float("nan"), 1.0) == "non-finite loss nan"
    assert guard.judge(2.0, float("inf")) == "non-finite gradient norm inf"
    assert guard.must_act and guard.skipped == 2 and guard.running_loss == 3.0
    assert guard.judge(9.5, 1.0).startswith("loss spike 9.5 > 3.0 x running average 3")
    assert guard.judge(8.9, 1.0) is None and guard.bad_in_a_row == 0  # below 3 x 3: a good step
    with pytest.raises(ValueError, match="on_repeated='retry'"):
        StepGuard(on_repeated="retry")


def poisoned_module(bad_batches: set[int], factor: float, guard: StepGuard):
    """The LightningModule whose loss is multiplied by `factor` on the micro-batches `bad_batches`."""
    module = lit_module(tiny_config(), lr=1e-3)
    module.guard = guard
    forward = module.forward

    def poisoned_forward(batch, **kwargs):
        out = forward(batch, **kwargs)
        if module.trainer.fit_loop.epoch_loop.batch_idx in bad_batches:
            out.loss = out.loss * factor
        return out

    module.forward = poisoned_forward
    return module


class Snapshots(L.Callback):
    """Weights, Muon state and correction biases, and the input ids, as each micro-batch starts."""

    def __init__(self):
        self.at_batch, self.inputs = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.inputs.append(batch["input_ids"].clone())
        self.at_batch.append(
            {
                "weights": {k: v.clone() for k, v in pl_module.model.state_dict().items()},
                "optimizer": {
                    id(p): {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                    for p, s in trainer.optimizers[0].state.items()
                },
            }
        )


def fit(module, tmp_path, steps: int, every: int = 1000):
    tokens = np.random.default_rng(0).integers(0, module.config.vocab_size, 50_000)
    data = DataLoader(MixtureWindows({"x": tokens}, {"x": 1.0}, 32, 0, 0, 0, 1, batch_size=2), batch_size=None)
    snapshots = Snapshots()
    balancer = ExpertBalancer(rate=Piecewise(values=[0.01], boundaries=[]), history_file=None)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every, save_last=True)
    trainer = L.Trainer(
        max_steps=steps,
        callbacks=[snapshots, balancer, checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[AtomicCheckpointIO()],
    )
    trainer.fit(module, train_dataloaders=data)
    return snapshots


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("factor", [float("nan"), 50.0])
def test_a_bad_step_changes_no_weight_optimizer_state_or_bias(tmp_path, factor):
    guard = StepGuard(warmup_steps=3, max_bad_steps=3)
    snapshots = fit(poisoned_module({5}, factor, guard), tmp_path, steps=8)
    before, after = snapshots.at_batch[5], snapshots.at_batch[6]  # around the bad batch 5
    assert same(before["weights"], after["weights"])  # e_score_correction_bias included: a buffer
    assert all(same(before["optimizer"][p], after["optimizer"][p]) for p in before["optimizer"])
    assert not same(snapshots.at_batch[6]["weights"], snapshots.at_batch[7]["weights"])  # then training goes on
    assert guard.skipped == 1 and guard.bad_in_a_row == 0


def test_bad_steps_in_a_row_roll_back_to_the_checkpoint_and_skip_the_bad_batches(tmp_path):
    guard = StepGuard(warmup_steps=2, max_bad_steps=2)
    snapshots = fit(poisoned_module({5, 6}, float("nan"), guard), tmp_path, steps=9, every=4)
    assert guard.rollbacks == 1 and guard.skipped == 2
    # after the second bad step: the weights and optimizer state of the checkpoint at step 4, not of step 5
    rolled_back, checkpointed = snapshots.at_batch[7], snapshots.at_batch[4]
    assert same(rolled_back["weights"], checkpointed["weights"])
    assert not same(rolled_back["weights"], snapshots.at_batch[5]["weights"])
    assert all(same(rolled_back["optimizer"][p], checkpointed["optimizer"][p]) for p in checkpointed["optimizer"])
    # the data goes on: 9 different batches, none replayed
    assert len(snapshots.inputs) == 9
    assert len({tuple(x.flatten().tolist()) for x in snapshots.inputs}) == 9


def test_on_repeated_stop_stops_with_a_message(tmp_path):
    guard = StepGuard(warmup_steps=2, max_bad_steps=2, on_repeated="stop")
    with pytest.raises(TrainingDiverged, match=r"step 5: 2 bad steps in a row \(guard.on_repeated=stop\)"):
        fit(poisoned_module({4, 5}, float("nan"), guard), tmp_path, steps=9, every=4)


def test_without_a_checkpoint_the_run_stops_instead_of_rolling_back(tmp_path):
    guard = StepGuard(warmup_steps=2, max_bad_steps=2)
    with pytest.raises(TrainingDiverged, match="no checkpoint to roll back to"):
        fit(poisoned_module({4, 5}, float("nan"), guard), tmp_path, steps=9)
