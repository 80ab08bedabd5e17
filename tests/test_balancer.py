"""The loss-free balancer through the real Trainer: MaxVio falls under it and stays high without it."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from glm46.lit import GLM46LitModule, TokenWindows
from glm46.lit.callbacks import ExpertBalancer, max_violation
from glm46.optim import Muon, Piecewise, WarmupCosine

from .helpers import tiny_config


class RecordMaxVio(L.Callback):
    def __init__(self):
        self.values = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.values.append(max_violation(pl_module.latest_expert_counts).mean().item())


def lit_module(config, lr=1e-4):
    return GLM46LitModule(
        config,
        optimizer=lambda groups: Muon(groups, lr=lr, ns_dtype=torch.float32),
        lr_schedule=WarmupCosine(warmup_tokens=0, total_tokens=1, min_factor=1.0),
        mtp_weight=Piecewise(values=[0.3], boundaries=[]),
    )


def skewed_run(balancer: ExpertBalancer | None, steps=40, accumulate=1):
    torch.manual_seed(0)
    config = tiny_config(n_routed_experts=8, num_experts_per_tok=2)
    module = lit_module(config)
    for router in module.model.routers():
        router.e_score_correction_bias[:2] = 0.3  # every token prefers experts 0 and 1
    tokens = torch.randint(0, config.vocab_size, (20_000,)).numpy()
    loader = DataLoader(TokenWindows(tokens, seq_len=32), batch_size=4, shuffle=True)
    recorder = RecordMaxVio()
    callbacks = [recorder] + ([balancer] if balancer else [])
    trainer = L.Trainer(
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=loader)
    return recorder.values, module


def test_maxvio_falls_under_the_balancer_and_stays_high_without():
    with_balancer, module = skewed_run(ExpertBalancer(rate=Piecewise(values=[0.02], boundaries=[]), history_file=None))
    without, _ = skewed_run(None)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    assert with_balancer[0] > 2.0 and without[0] > 2.0, "the skewed routers should start far from balance"
    assert mean(with_balancer[-10:]) < 0.5 * with_balancer[0]
    assert mean(with_balancer[-10:]) < 0.5 * mean(without[-10:])
    assert mean(without[-10:]) > 0.8 * mean(without[:5])
    biases = torch.stack([r.e_score_correction_bias for r in module.model.routers()])
    assert (biases[:, :2] < 0.3).all(), "the overloaded experts' bias must have come down"


@pytest.mark.parametrize("rule", ["sign", "proportional"])
def test_bias_update_rule_sums_micro_batches_of_a_step(rule):
    balancer = ExpertBalancer(rate=Piecewise(values=[0.5], boundaries=[]), rule=rule, history_file=None)
    _, module = skewed_run(balancer, steps=1, accumulate=3)
    assert balancer.pending is None
    ((step, counts),) = balancer.history
    assert step == 0 and (counts.sum(dim=-1) == 3 * 4 * 32 * 2).all()  # 3 micro-batches of 4 x 32 tokens, top-2
    mean = counts.mean(dim=-1, keepdim=True)
    expected = (mean - counts).sign() if rule == "sign" else (mean - counts) / mean
    moved = torch.stack([r.e_score_correction_bias for r in module.model.routers()])
    moved[:, :2] -= 0.3
    torch.testing.assert_close(moved, 0.5 * expected)
