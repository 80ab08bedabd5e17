"""PPO with a critic on one process: it learns an easy task, its critic warms up alone while the policy stays where
it started, and its KL penalty against the starting policy is 0 on the first rollout and grows after."""

from functools import partial

import lightning as L
import pytest
import torch

from glm46.checkpoint import save_hf
from glm46.peft import AdapterSettings
from glm46.rl.core_algos import kl_estimate, policy_loss
from glm46.rl.grpo_module import GRPOSettings
from glm46.rl.ppo_module import PPOLitModule, PPOSettings

from .helpers import random_model, tiny_config
from .test_grpo import LR, dataset, fit, rewards_logged, starts_with_a_digit

__all__ = ["dataset"]  # the fixture: test_grpo's prepared chat data (vocabulary 400)


def ppo_module(dataset, init_from=None, **settings) -> PPOLitModule:
    L.seed_everything(0)
    return PPOLitModule(
        tiny_config(vocab_size=400),
        optimizer=partial(torch.optim.AdamW, lr=LR),
        lr_schedule=lambda tokens: 1.0,
        mtp_weight=lambda tokens: 0.0,
        init_from=init_from,
        tokenizer_path=str(dataset / "tokenizer.json"),
        grpo=GRPOSettings(samples_per_prompt=2, max_new_tokens=4, temperature=1.0, scale_rewards=False),
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
    module.reward = lambda record, completion: 1.0  # returns of 1 for a critic that starts at 0
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
