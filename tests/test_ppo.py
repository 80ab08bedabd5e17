"""PPO with a critic on one process: it learns an easy task, its critic warms up alone while the policy stays where
it started, and its KL penalty against the starting policy is 0 on the first rollout and grows after; the actor and
the critic step their own optimizers under their own clips; epochs pass over each rollout batch in minibatches; the
adaptive KL coefficient moves by its formula and comes back on a resume."""

from functools import partial

import lightning as L
import pytest
import torch

from glm46.checkpoint import save_hf
from glm46.peft import AdapterSettings
from glm46.rl.core_algos import kl_estimate, policy_loss
from glm46.rl.grpo_settings import GRPOSettings
from glm46.rl.ppo_module import PPOLitModule, PPOSettings

from .helpers import random_model, tiny_config
from .test_grpo import LR, dataset, fit, rewards_logged, starts_with_a_digit

__all__ = ["dataset"]  # the fixture: test_grpo's prepared chat data (vocabulary 400)


def ppo_module(dataset, init_from=None, grpo=None, **settings) -> PPOLitModule:
    L.seed_everything(0)
    grpo = dict(samples_per_prompt=2, max_new_tokens=4, temperature=1.0, scale_rewards=False) | (grpo or {})
    return PPOLitModule(
        tiny_config(vocab_size=400),
        optimizer=partial(torch.optim.AdamW, lr=LR),
        lr_schedule=lambda tokens: 1.0,
        mtp_weight=lambda tokens: 0.0,
        init_from=init_from,
        tokenizer_path=str(dataset / "tokenizer.json"),
        grpo=GRPOSettings(**grpo),
        reward=starts_with_a_digit,
        seed=0,
        ppo=PPOSettings(**settings),
    )


@pytest.mark.slow
def test_ppo_learns_an_easy_task(dataset, tmp_path):
    fit(ppo_module(dataset, critic_warmup_steps=2), dataset, tmp_path, max_steps=30)
    rewards = rewards_logged(tmp_path)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.3 and last > first + 0.4, rewards
    assert max(rewards_logged(tmp_path, "rl/value_loss")) > 0


def test_the_critic_warms_up_alone(dataset, tmp_path):
    module = ppo_module(dataset, critic_warmup_steps=2)
    module.worker.reward = lambda record, completion: 1.0  # returns of 1 for a critic that starts at 0
    policy = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    critic = {name: p.detach().clone() for name, p in module.critic.named_parameters() if p.requires_grad}
    fit(module, dataset, tmp_path, max_steps=2)
    assert all(torch.equal(p, policy[name]) for name, p in module.model.named_parameters())
    assert not torch.equal(module.critic.head.weight, critic["head.weight"])  # the head starts at 0 and learns
    assert "rl/clip_fraction" not in (tmp_path / "metrics.csv").read_text().splitlines()[0]  # no policy loss yet


def test_the_kl_penalty_starts_at_zero_and_grows(dataset, tmp_path, monkeypatch):
    """Each rollout's KL estimates, recorded as the module computes them: 0 while the policy is the reference."""
    import glm46.rl.ppo_module as ppo

    means = []

    def recorded(logprobs, reference, estimator):
        kl = kl_estimate(logprobs, reference, estimator)
        means.append(float(kl.abs().max()))
        return kl

    monkeypatch.setattr(ppo, "kl_estimate", recorded)
    start = save_hf(random_model(tiny_config(vocab_size=400), seed=0), tmp_path / "start")
    module = ppo_module(dataset, init_from=str(start), kl_coef=0.1, kl_estimator="k3")
    fit(module, dataset, tmp_path, max_steps=3)
    assert len(means) == 3 and means[0] == 0 and means[-1] > 0, means


@pytest.mark.parametrize("peft", [None, AdapterSettings(r=8, alpha=16, lr=3e-2)], ids=["full", "lora"])
def test_grpo_kl_term_is_against_the_starting_policy(dataset, tmp_path, monkeypatch, peft):
    """GRPO with phase.grpo.kl_coef > 0 holds the policy init_from names: its first update's KL is 0, later ones not.
    Under LoRA no copy is held: the reference is the base with the adapters off."""
    import glm46.rl.grpo_module as grpo

    kls = []

    def recorded(*args, **kwargs):
        loss, stats = policy_loss(*args, **kwargs)
        kls.append(float(stats["kl"]))
        return loss, stats

    monkeypatch.setattr(grpo, "policy_loss", recorded)
    start = save_hf(random_model(tiny_config(vocab_size=400), seed=0), tmp_path / "start")
    L.seed_everything(0)
    module = grpo.GRPOLitModule(
        tiny_config(vocab_size=400),
        optimizer=partial(torch.optim.AdamW, lr=LR),
        lr_schedule=lambda tokens: 1.0,
        mtp_weight=lambda tokens: 0.0,
        init_from=str(start),
        tokenizer_path=str(dataset / "tokenizer.json"),
        grpo=GRPOSettings(samples_per_prompt=2, max_new_tokens=4, kl_coef=0.1),
        reward=starts_with_a_digit,
        seed=0,
        peft=peft,
    )
    fit(module, dataset, tmp_path, max_steps=3)
    assert len(kls) == 3 and kls[0] == 0 and kls[-1] > 0, kls
    assert (module.reference == []) == (peft is not None)


@pytest.mark.parametrize(("actor_clip", "critic_clip"), [(1e-12, 1.0), (1.0, 1e-12)], ids=["actor", "critic"])
def test_actor_and_critic_step_their_own_optimizers_under_their_own_clips(dataset, tmp_path, actor_clip, critic_clip):
    """Two optimizers over disjoint parameters, one global step per update (the critic's steps are not counted),
    and each clip on its own model's norm: clipped to 1e-12, a model stays where it was (AdamW's step of such a
    gradient is about 1e-5 x its LR, and weight decay 0.01 x its LR) while the other moves by about its LR (3e-3);
    under one clip over both, both would stay."""
    module = ppo_module(dataset, critic_grad_clip=critic_clip)
    module.gradient_clip_val = actor_clip
    module.worker.reward = lambda record, completion: 1.0  # returns of 1 for a critic that starts at 0
    policy = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    trainer = fit(module, dataset, tmp_path, max_steps=2)
    actor, critic = trainer.optimizers
    stepped = [{id(p) for group in o.param_groups for p in group["params"]} for o in (actor, critic)]
    assert stepped[0] == {id(p) for p in module.model.parameters() if p.requires_grad}
    assert stepped[1] == {id(p) for p in module.critic.parameters() if p.requires_grad}
    assert trainer.global_step == 2 and {int(s["step"]) for s in critic.state.values()} == {2}
    actor_moved = max(float((p.detach() - policy[name]).abs().max()) for name, p in module.model.named_parameters())
    critic_moved = float(module.critic.head.weight.detach().abs().max())  # the head starts at 0
    moved, still = (critic_moved, actor_moved) if actor_clip < critic_clip else (actor_moved, critic_moved)
    assert moved > 1e-3 and still < 1e-4, (actor_moved, critic_moved)


def test_epochs_pass_over_each_rollout_batch_in_minibatches_the_later_ones_shuffled(dataset, tmp_path, monkeypatch):
    """epochs=2 x updates_per_rollout=2: four updates per rollout batch, the global step counting each; the second
    pass holds the same rows in another order, with the log-probs the rollout policy gave them."""
    updates, rollouts = [], []
    update, rollout = PPOLitModule.update, PPOLitModule.rollout
    monkeypatch.setattr(PPOLitModule, "update", lambda self, part: updates.append(part) or update(self, part))
    monkeypatch.setattr(PPOLitModule, "rollout", lambda self, batch: rollouts.append(rollout(self, batch))
                        or rollouts[-1])  # fmt: skip
    trainer = fit(ppo_module(dataset, grpo={"epochs": 2, "updates_per_rollout": 2}), dataset, tmp_path, max_steps=8)
    assert trainer.global_step == 8 and len(rollouts) == 2 and len(updates) == 8
    for whole, parts in zip(rollouts, (updates[:4], updates[4:])):
        rows = [(tuple(r.tolist()), tuple(o.tolist())) for r, o in zip(whole.input_ids, whole.old_logprobs)]
        passes = [
            [(tuple(r.tolist()), tuple(o.tolist())) for part in half for r, o in zip(part.input_ids, part.old_logprobs)]
            for half in (parts[:2], parts[2:])
        ]
        assert passes[0] == rows and sorted(passes[1]) == sorted(rows) and passes[1] != rows


def test_the_adaptive_kl_coefficient_follows_its_formula_and_is_in_the_checkpoint(dataset, tmp_path, monkeypatch):
    """Each rollout's KL (the mean of each reply's mean, recorded as the module computes it) moves the coefficient
    by value x (1 + clip(kl / target - 1, -0.2, 0.2) x n / horizon); a resume goes on from the saved value."""
    import glm46.rl.ppo_module as ppo

    kls = []

    def recorded(logprobs, reference, estimator):
        kl = kl_estimate(logprobs, reference, estimator)
        kls.append(kl)
        return kl

    monkeypatch.setattr(ppo, "kl_estimate", recorded)
    start = save_hf(random_model(tiny_config(vocab_size=400), seed=0), tmp_path / "start")
    settings = dict(kl_coef=0.1, kl_estimator="k1", kl_target=1e-3, kl_horizon=40)
    module = ppo_module(dataset, init_from=str(start), **settings)
    module.worker.reward = lambda record, completion: 1.0
    masks = []
    estimate = PPOLitModule.estimate_advantages
    monkeypatch.setattr(PPOLitModule, "estimate_advantages",
                        lambda self, r, rewards: masks.append(r.mask) or estimate(self, r, rewards))  # fmt: skip
    fit(module, dataset, tmp_path, max_steps=3, every=3)
    expected = 0.1
    for kl, mask in zip(kls, masks):
        current = float(((kl * mask).sum(1) / mask.sum(1)).mean())
        expected *= 1 + min(max(current / 1e-3 - 1, -0.2), 0.2) * len(mask) / 40
    assert len(kls) == 3 and module.kl.value == pytest.approx(expected, rel=1e-6) and module.kl.value != 0.1
    resumed = ppo_module(dataset, init_from=str(start), **settings)
    fit(resumed, dataset, tmp_path / "resumed", max_steps=3, ckpt_path=str(tmp_path / "checkpoints" / "last.ckpt"))
    assert resumed.kl.value == pytest.approx(expected, rel=1e-6)
