"""PPOLitModule: PPO with a critic (Schulman et al. 2017; InstructGPT's RLHF, arXiv:2203.02155), the classic
four-model system: the actor (the policy, `model`), the critic (`critic`: a GLM backbone with a scalar value head,
by default started from the reward model), the reference (the frozen starting policy, for the KL penalty) and the
reward model (glm46.rl.rlhf, beside the verifier).

It is GRPOLitModule with another advantage estimator and a second loss; rollouts (local generate or vLLM, single
turns or multi-turn episodes with tools), rewards, the data position and the policy's clipped loss are GRPO's.
Each rollout batch:
1. The sampling policy's log-probs of every completion token (before any update moves it), the reference's when
   `kl_coef` > 0, and the critic's values V_t (its head on the state before each token).
2. Token rewards: the sequence's reward at its last token, minus kl_coef x the KL estimate (k1 or k3) at every
   token (glm46.rl.core_algos.kl_estimate), as verl's `use_kl_in_reward` and TRL's PPO shape them.
3. GAE with gamma and lambda over the model's tokens (a multi-turn episode's tool results are skipped, not a cut),
   the advantages whitened over every data-parallel rank's tokens; returns = advantages + values.
4. `epochs` passes over the rollout, each in `updates_per_rollout` minibatches (phase.grpo; the later passes in a
   seeded shuffle): the clipped policy loss with per-token advantages plus the clipped value loss, one backward,
   then each model's own gradient clip and optimizer (the critic's at critic_lr_scale x the actor's LR, as verl's
   and TRL's separate actor and critic optimizers). For the first `critic_warmup_steps` steps only the critic learns
   (its values start far from the returns of a new reward).
5. With `kl_target`, the penalty's coefficient adapts after each rollout batch (glm46.rl.core_algos.KLController,
   Ziegler et al. 2019); without it, it stays at kl_coef. PPO's KL is this penalty alone: phase.grpo.kl_coef, GRPO's
   loss term, is refused with module=ppo.

The critic takes the actor's layout (FSDP2, EP: sharded, its head replicated and its gradient averaged); the
reference is held whole on every rank, as the reward model is (glm46.rl.rlhf says why). The critic is in the
checkpoints; the reference is read again from `init_from` on a resume (it is the starting policy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from glm46.checkpoint import find_weights
from glm46.checkpoint.weights import load_weights
from glm46.errors import ConfigError
from glm46.modules import GLM46ForCausalLM
from glm46.optim import muon_param_groups
from glm46.parallel.data_parallel import (
    average_gradients_in_backward,
    data_parallel_group,
    data_parallel_rank_and_size,
)
from glm46.parallel.materialize import has_meta_tensors, materialize
from glm46.rl.core_algos import KL_ESTIMATORS, KLController, gae_advantages, kl_estimate, masked_whiten, value_loss
from glm46.rl.grpo_module import GRPOLitModule
from glm46.rl.reward_export import reward_head
from glm46.rl.rollout_batch import Rollout


@dataclass
class PPOSettings:
    """The PPO settings of an RL phase (`phase.ppo`, conf/phase/rl.yaml), beside its GRPO settings (sampling, clip)."""

    gamma: float = 1.0  # the discount over a reply's tokens (verl's and TRL's default)
    lam: float = 0.95  # GAE's lambda (TRL's default)
    value_clip: float = 0.2  # the clipped value loss's range around the rollout's values (TRL's cliprange_value)
    critic_lr_scale: float = 1.0  # the critic's LR over the actor's
    critic_warmup_steps: int = 0  # steps that train the critic alone (verl's critic_warmup)
    critic_init: Optional[str] = None  # a reward model's export (its head too), or any export; None: the policy's
    critic_grad_clip: Optional[float] = None  # the critic's gradient-norm clip; None: the actor's value
    kl_coef: float = 0.0  # the KL penalty in the token rewards against the starting policy; 0: no reference held
    kl_estimator: str = "k1"  # k1 | k3 (glm46.rl.core_algos.kl_estimate)
    kl_target: Optional[float] = None  # the KL the coefficient adapts to (verl's and TRL's adaptive controller)
    kl_horizon: int = 10000  # sequences over which the coefficient moves by at most 20%
    whiten_advantages: bool = True

    def __post_init__(self):
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ConfigError(f"phase.ppo.gamma={self.gamma} and phase.ppo.lam={self.lam} must lie in [0, 1]")
        if self.value_clip <= 0 or self.critic_lr_scale <= 0 or self.critic_warmup_steps < 0 or self.kl_coef < 0:
            raise ConfigError(
                f"phase.ppo: value_clip={self.value_clip} and critic_lr_scale={self.critic_lr_scale} must be > 0, "
                f"critic_warmup_steps={self.critic_warmup_steps} and kl_coef={self.kl_coef} >= 0"
            )
        if self.kl_target is not None and (self.kl_target <= 0 or self.kl_horizon <= 0 or self.kl_coef <= 0):
            raise ConfigError(
                f"phase.ppo.kl_target={self.kl_target}: an adaptive KL needs kl_target > 0, kl_horizon > 0 "
                f"(got {self.kl_horizon}) and a starting kl_coef > 0 (got {self.kl_coef})"
            )
        if self.critic_grad_clip is not None and self.critic_grad_clip <= 0:
            raise ConfigError(f"phase.ppo.critic_grad_clip={self.critic_grad_clip} must be > 0, or null")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"phase.ppo.kl_estimator={self.kl_estimator!r}: expected {' or '.join(KL_ESTIMATORS)}")


class ValueModel(nn.Module):
    """A GLM backbone and a bias-free scalar head on its final norm's output: V [N, T] at every position."""

    def __init__(self, backbone: GLM46ForCausalLM):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.config.hidden_size, 1, bias=False)
        nn.init.zeros_(self.head.weight)
        for unused in (backbone.lm_head, backbone.mtp_layers):
            unused.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return self.head(self.backbone.hidden_states(input_ids, positions)).squeeze(-1).float()

    def load(self, path: str) -> None:
        """The backbone's weights from an export or checkpoint, and the head from a reward model's (else zeros)."""
        head = reward_head(path)
        load_weights(self.backbone, str(find_weights(path)) if head is not None else path)
        if head is not None:
            with torch.no_grad():
                self.head.weight.copy_(head)


class PPOLitModule(GRPOLitModule):
    def __init__(self, *args, ppo: PPOSettings, **kwargs):
        """GRPOLitModule's arguments, plus the RL phase's PPO settings (`phase.ppo`; conf/module/ppo.yaml)."""
        super().__init__(*args, **kwargs)
        self.ppo = ppo
        self.kl = KLController(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon)
        meta = has_meta_tensors(self.model)
        with torch.device("meta") if meta else torch.device("cpu"):
            self.critic = ValueModel(GLM46ForCausalLM(self.config))

    # -- the other models
    def configure_model(self) -> None:
        """The actor's layout, then the critic's (the strategy's own), its weights and the frozen reference."""
        configured = self._configured
        super().configure_model()
        if configured:
            return
        parallelize = getattr(self.trainer.strategy, "parallelize", None)
        if parallelize is not None:
            parallelize(self.critic.backbone)
        if has_meta_tensors(self.critic):
            materialize(self.critic.backbone, self.device)
            self.critic.head.to_empty(device=self.device)
            nn.init.zeros_(self.critic.head.weight)
        self.critic.head.to(self.device)
        start = self.ppo.critic_init or self.init_from
        if start:
            self.critic.load(start)
        if isinstance(self.critic.backbone, FSDPModule):
            register_fsdp_forward_method(self.critic.backbone, "hidden_states")
        average_gradients_in_backward([self.critic.head.weight], self.trainer.strategy)

    @property
    def uses_reference(self) -> bool:
        """GRPO's KL term, or PPO's KL penalty in the token rewards."""
        return super().uses_reference or self.ppo.kl_coef > 0

    def configure_optimizers(self):
        """The actor's optimizer and schedule, then the critic's: the same optimizer and schedule over its own groups,
        at critic_lr_scale x the LR."""
        actor = super().configure_optimizers()
        groups = muon_param_groups(self.critic.backbone)
        next(group for group in groups if not group["use_muon"])["params"].append(self.critic.head.weight)
        optimizer = self.optimizer_factory(groups)
        for group in optimizer.param_groups:
            group["lr"] *= self.ppo.critic_lr_scale
        return [actor, self.scheduled(optimizer)]

    def step_optimizer(self, loss: torch.Tensor) -> None:
        """One backward of the summed losses, then each model's own clip and step: the critic's first, stepped as
        torch's optimizer (Lightning counts every step of its wrapped optimizers as a global step: the actor's is
        the update's one)."""
        critic, schedule = self.optimizers(use_pl_optimizer=False)[1], self.lr_schedulers()[1]
        self.manual_backward(loss)
        clip = self.ppo.critic_grad_clip or self.gradient_clip_val
        if clip:
            self.configure_gradient_clipping(critic, clip, "norm")
        critic.step()
        critic.zero_grad(set_to_none=True)
        schedule.step()
        self.step_policy()

    # -- advantages
    @torch.no_grad()
    def estimate_advantages(self, rollout: Rollout, rewards: torch.Tensor) -> torch.Tensor:
        """GAE over the critic's values [N, T], from the token rewards; sets the rollout's old log-probs, old values
        and returns."""
        mask = rollout.mask
        rollout.old_logprobs = self.logprobs(rollout.input_ids, rollout.targets)[0]
        rollout.old_values = self.critic(rollout.input_ids) * mask
        token_rewards = torch.zeros_like(mask)
        last = (mask * torch.arange(1, mask.shape[1] + 1, device=mask.device)).argmax(dim=1)
        token_rewards[torch.arange(len(mask), device=mask.device), last] = rewards.float()
        if self.ppo.kl_coef > 0:
            reference = self.reference_logprobs(rollout.input_ids, rollout.targets)
            kl = kl_estimate(rollout.old_logprobs, reference, self.ppo.kl_estimator) * mask
            token_rewards = token_rewards - self.kl.value * kl
            self.log("rl/kl", (kl.sum() / mask.sum().clamp(min=1)), sync_dist=True)
            self.log("rl/kl_coef", self.kl.value)
            if self.ppo.kl_target is not None:  # adaptive: the mean of each reply's mean KL (verl's), over the ranks
                sequence_kl = (kl.sum(1) / mask.sum(1).clamp(min=1)).mean()
                self.kl.update(self.rank_mean(sequence_kl), len(mask) * data_parallel_rank_and_size(self.trainer)[1])
        advantages, rollout.returns = gae_advantages(
            token_rewards, rollout.old_values, mask, self.ppo.gamma, self.ppo.lam
        )
        self.log("rl/value_mean", (rollout.old_values.sum() / mask.sum().clamp(min=1)), sync_dist=True)
        return self.whitened(advantages, mask) if self.ppo.whiten_advantages else advantages

    def whitened(self, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Advantages whitened with the mean and variance of every data-parallel rank's tokens."""
        _, ranks = data_parallel_rank_and_size(self.trainer)
        if ranks == 1:
            return masked_whiten(advantages, mask)
        group = data_parallel_group(self.trainer.strategy)
        totals = torch.stack([(advantages * mask).sum(), mask.sum()])
        torch.distributed.all_reduce(totals, group=group)
        mean = totals[0] / (totals[1] + 1e-8)
        spread = (((advantages - mean) ** 2) * mask).sum()
        torch.distributed.all_reduce(spread, group=group)
        return masked_whiten(advantages, mask, mean, spread / (totals[1] + 1e-8) * totals[1] / (totals[1] - 1))

    # -- the update
    def update(self, part: Rollout) -> dict[str, torch.Tensor]:
        """The critic's clipped value loss, plus the actor's policy loss once the critic's warm-up is over."""
        values = self.critic(part.input_ids)
        loss, clip_fraction = value_loss(
            values,
            part.old_values,
            part.returns,
            part.mask,
            self.ppo.value_clip,
            num_tokens=self.global_token_share(part.mask, "token_mean"),
        )
        stats = {"value_loss": loss.detach(), "value_clip_fraction": clip_fraction}
        warming_up = self.trainer.global_step < self.ppo.critic_warmup_steps
        if not warming_up:
            policy, policy_stats = self.policy_objective(part)
            loss = loss + policy
            stats |= policy_stats
        self.step_optimizer(loss)
        for name in ("value_loss", "value_clip_fraction"):
            self.log(f"rl/{name}", stats[name], sync_dist=True)
        return {"loss": loss.detach(), **stats}

    # -- checkpoint
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["rl"]["kl_coef"] = self.kl.value

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.kl.value = checkpoint["rl"].get("kl_coef", self.ppo.kl_coef)  # older checkpoints: the fixed one
