"""The math of the RL steps, as small functions in one place (verl's `core_algos.py` is the model): advantage
estimators (GRPO's group-normalised rewards; GAE over a critic's values, `gae_advantages`), per-token log-probs, the
clipped policy loss, PPO's clipped value loss and the KL estimators of a penalty against a reference policy.

GLM-4.5 trains its RL stages with GRPO without the KL term, in slime (arXiv:2508.06471 section 3.2; the loss of
slime's ppo_utils.py `compute_policy_loss`), with DAPO's clip-higher (arXiv:2503.14476) as an option. TRL's
GRPOTrainer (trl/trainer/grpo_trainer.py `_compute_loss`) computes the same loss: tests/test_grpo_loss.py checks
that ours equals it, log-probs, loss and gradients.
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from glm46.modules.loss import IGNORE_INDEX

AGGREGATIONS = ("token_mean", "seq_mean")


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_rewards: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO's advantage: each reward minus its group's mean, over the group's std when scale_rewards.

    rewards [N] lie group by group (N = prompts x group_size, the samples of one prompt consecutive). The std is
    Bessel-corrected, as slime's `_post_process_rewards` and TRL's `nanstd`; eps is slime's 1e-6 (TRL uses 1e-4),
    and an all-equal group gets advantages 0, not NaN. scale_rewards=False is Dr. GRPO's unscaled advantage. A group
    of one has no std: slime switches the division off there, and its advantage is 0 either way. Returns [N].
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [prompts x group_size], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_size must be >= 1 and divide the {rewards.numel()} rewards, got {group_size}")
    groups = rewards.float().view(-1, group_size)  # [prompts, group_size]
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if scale_rewards and group_size > 1:
        advantages = advantages / (groups.std(dim=1, keepdim=True) + eps)
    return advantages.view(-1)


def unscored_filled(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Rewards [N] with each NaN (a row its verifier could not score: a sandbox that did not start) replaced by the
    mean of its group's scored rows (0 where none is): the group's mean is unchanged, the row's advantage is 0, and
    the caller leaves it out of the loss."""
    groups = rewards.view(-1, group_size)
    scored = ~groups.isnan()
    means = torch.where(scored, groups, 0.0).sum(1, keepdim=True) / scored.sum(1, keepdim=True).clamp(min=1)
    return torch.where(scored, groups, means).view(-1)


def flat_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which groups' rewards are all equal [prompts]: their advantages are 0 and give no gradient (DAPO's dynamic
    sampling, arXiv:2503.14476, drops them). rewards [N] lie group by group, as group_advantages takes them."""
    groups = rewards.view(-1, group_size)
    return (groups == groups[:, :1]).all(dim=1)


def _chunk_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target log-probs [n] and entropies [n] (no grad: logging only) of one chunk; hidden [n, H], targets [n]."""
    logits = F.linear(hidden, weight).float() / temperature  # [n, V]
    logprobs = logits.log_softmax(dim=-1)
    target = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logprobs.exp() * logprobs).sum(dim=-1)
    return target, entropy


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 4096,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-prob [B, T] of each target under softmax(hidden @ weight.T / temperature), 0 where the target is
    IGNORE_INDEX; with return_entropy also each position's entropy [B, T], detached (for logging).

    hidden [B, T, H] (the final normed hidden states), weight [V, H] (lm_head), targets [B, T]. The logits are divided
    by the sampling temperature, as TRL and slime do, so the log-probs match those of the rollout; log_softmax runs in
    fp32 on logits of hidden's dtype, as in glm46.modules.loss. Only the targets' positions go through lm_head (a
    prompt's positions have none: in RL most of a row). Chunks of chunk_size of them are checkpointed, so one chunk's
    [tokens, V] logits exist at a time, in the backward pass too.
    """
    if temperature <= 0 or chunk_size < 1:
        raise ValueError(f"need temperature > 0 and chunk_size >= 1, got {temperature} and {chunk_size}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} differ in [B, T]")
    kept = (targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)  # [n] the targets' positions in [B*T]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])[kept]  # [n, H]: only these go through lm_head
    flat_targets = targets.reshape(-1)[kept]  # [n]
    if flat_hidden.shape[0] <= chunk_size:  # one chunk: recomputing its logits would save nothing
        logprobs, entropy = _chunk_logprobs(flat_hidden, weight, flat_targets, temperature)
    else:
        chunks = [
            checkpoint(_chunk_logprobs, h, weight, y, temperature, use_reentrant=False)
            for h, y in zip(flat_hidden.split(chunk_size), flat_targets.split(chunk_size))
        ]
        logprobs, entropy = (torch.cat(parts) for parts in zip(*chunks))
    logprobs, entropy = (
        targets.new_zeros(targets.shape, dtype=v.dtype).view(-1).index_put((kept,), v) for v in (logprobs, entropy)
    )
    if return_entropy:
        return logprobs.view(targets.shape), entropy.view(targets.shape)
    return logprobs.view(targets.shape)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of values [B, T] over the tokens of mask [B, T] (float 0/1), detached: a logged statistic."""
    return ((values * mask).sum() / mask.sum().clamp(min=1)).detach()


def _aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, aggregation: str, num_tokens: torch.Tensor | float | None
) -> torch.Tensor:
    """The scalar loss of per_token [B, T] over mask [B, T]: DAPO's token mean (TRL's "dapo", divided by the
    token count, or by num_tokens, e.g. the global count over data-parallel ranks / their number) or the mean of
    each row's token mean (TRL's "grpo", slime's default)."""
    if aggregation == "token_mean":
        count = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, device=per_token.device)
        return (per_token * mask).sum() / count.clamp(min=1)
    return ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()


def _check_policy_args(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    aggregation: str,
    num_tokens: torch.Tensor | float | None,
    kl_coef: float,
    ref_logprobs: torch.Tensor | None,
    token_weights: torch.Tensor | None,
    eps_clip_c: float | None,
) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; allowed: {', '.join(AGGREGATIONS)}")
    if num_tokens is not None and aggregation != "token_mean":
        raise ValueError(f"num_tokens is the divisor of aggregation='token_mean' only, got {aggregation!r}")
    if not 0 <= eps_low < 1 or eps_high < 0:
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if eps_clip_c is not None and eps_clip_c <= 1:
        raise ValueError(f"eps_clip_c (dual clip) must be > 1, got {eps_clip_c}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs, the reference model's log-probs [B, T]")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    if token_weights is not None and token_weights.requires_grad:
        raise ValueError("token_weights must be detached: they weigh the loss, they are not optimized")
    tensors = {"old_logprobs": old_logprobs, "mask": mask, "ref_logprobs": ref_logprobs, "token_weights": token_weights}
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} {tuple(tensor.shape)} differs from logprobs {tuple(logprobs.shape)}")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages must be [B] = {tuple(logprobs.shape[:1])}, or [B, T] = {tuple(logprobs.shape)} (one per "
            f"token: GAE's), got {tuple(advantages.shape)}"
        )


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    aggregation: str = "token_mean",
    num_tokens: torch.Tensor | float | None = None,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's clipped surrogate: -min(ratio * A, clamp(ratio, 1 - eps_low, 1 + eps_high) * A) per token, aggregated.

    logprobs [B, T] (with grad), old_logprobs [B, T] (the rollout policy's), advantages [B] (GRPO's, one per
    sequence) or [B, T] (PPO's, one per token), mask [B, T] (1 on the completion tokens that count). eps_high None
    is eps_low; DAPO's clip-higher uses 0.28. kl_coef > 0 adds TRL's beta term, the k3 estimate of
    KL(policy || reference) (kl_estimate); GLM-4.5 trains without it. token_weights [B, T]
    (detached) multiply each token's loss before the aggregation: the truncated importance ratios
    min(exp(old_logprobs - engine_logprobs), C) of a rollout sampled by an inference engine (slime's `--use-tis`,
    TRL's `vllm_importance_sampling_correction`). eps_clip_c > 1 is dual-clip PPO's bound (Ye et al. 2020,
    arXiv:1912.09729; verl's `clip_ratio_c`, slime's `--eps-clip-c`): where the advantage is negative, a token's loss
    is at most -eps_clip_c x A, however far the ratio has grown; None: no such bound.
    Returns the loss and detached statistics: clip_fraction (the masked tokens whose clip is active,
    TRL's `clip_ratio/region_mean` and slime's clipfrac), ratio_mean, and kl when ref_logprobs is given.
    """
    eps_high = eps_low if eps_high is None else eps_high
    _check_policy_args(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        eps_low,
        eps_high,
        aggregation,
        num_tokens,
        kl_coef,
        ref_logprobs,
        token_weights,
        eps_clip_c,
    )
    valid = mask.bool()
    weights = valid.to(logprobs.dtype)  # [B, T]
    # Padding may hold anything (a sampler's -inf): ratio 1 there keeps exp and its gradient finite.
    ratio = (logprobs - old_logprobs).masked_fill(~valid, 0.0).exp()  # [B, T]
    advantages = advantages.to(logprobs.dtype)
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # [B, 1] or [B, T]
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = -torch.min(ratio * advantages, clipped * advantages)  # [B, T]
    if eps_clip_c is not None:  # dual clip: a negative advantage's loss is at most -eps_clip_c x A
        per_token = torch.where(advantages < 0, torch.min(per_token, -eps_clip_c * advantages), per_token)
    if token_weights is not None:
        per_token = per_token * token_weights
    clip_active = ((ratio < 1 - eps_low) & (advantages < 0)) | ((ratio > 1 + eps_high) & (advantages > 0))
    stats = {
        "clip_fraction": _masked_mean(clip_active.to(weights.dtype), weights),
        "ratio_mean": _masked_mean(ratio, weights),
    }
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, ref_logprobs, "k3").masked_fill(~valid, 0.0)  # [B, T]
        stats["kl"] = _masked_mean(kl, weights)
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
    return _aggregate(per_token, weights, aggregation, num_tokens), stats


def truncated_importance_weights(
    trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance sampling (TIS; Yao et al. 2025): min(pi_trainer / pi_engine, cap) per token [B, T].

    An inference engine samples from numbers slightly different from the trainer's (its kernels, its precision), so
    its rollout is off-policy by that gap; weighing each token's loss by the ratio corrects it, and the cap bounds
    the variance of rare tokens the engine under-rated. trainer_logprobs are the trainer's under the rollout policy,
    engine_logprobs the engine's of the same tokens, both [B, T]; the result is detached (slime's `tis_clip`, TRL's
    `vllm_importance_sampling_cap`, both 2.0 by default).
    """
    return (trainer_logprobs - engine_logprobs).exp().clamp(max=cap).detach()


def width_groups(targets: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """Rows [N, T] as two groups (their indices, the width up to their last target), split by length where the
    padding they keep is least: a batch of multi-turn episodes mixes rows of very different lengths. Always two
    groups (one for a single row), so that ranks whose forwards are collective (FSDP2, EP) run as many."""
    rows, width = targets.shape
    columns = torch.arange(1, width + 1, device=targets.device)
    ends = ((targets != IGNORE_INDEX) * columns).amax(1).clamp(min=1)  # [N] one past each row's last target
    order = torch.argsort(ends, descending=True, stable=True)
    ends = ends[order].tolist()
    if rows == 1:
        return [(order, ends[0])]
    k = min(range(1, rows), key=lambda k: k * ends[0] + (rows - k) * ends[k])
    return [(order[:k], ends[0]), (order[k:], ends[k])]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of values over mask (verl's `masked_mean`: the sum over the count + 1e-8)."""
    return (values * mask).sum() / (mask.sum() + 1e-8)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, mean: torch.Tensor | None = None, var: torch.Tensor | None = None
) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) over mask, the variance Bessel-corrected (verl's `masked_whiten`). `mean`
    and `var` given: those of the whole batch over several ranks (they differ from one rank's)."""
    if mean is None:
        mean = masked_mean(values, mask)
    if var is None:
        count = mask.sum()
        if count < 2:
            raise ValueError(f"whitening needs at least 2 tokens under the mask, got {int(count)}")
        var = masked_mean((values - mean) ** 2, mask) * count / (count - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (arXiv:1506.02438) over each row's tokens, as verl's
    `compute_gae_advantage_return` (before its whitening): (advantages, returns = advantages + values), both [B, T].

    token_rewards, values and mask are [B, T], position t holding the token the model wrote there (its value: the
    critic's at the state before it). delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next, where
    "next" is the next position under the mask: tokens outside it (a multi-turn episode's tool results, padding)
    neither hold a TD error nor interrupt the chain. Whiten the advantages over the batch (`masked_whiten`)."""
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        kept = mask[:, t]
        next_value = values[:, t] * kept + (1 - kept) * next_value
        next_advantage = advantage * kept + (1 - kept) * next_advantage
        advantages[:, t] = next_advantage
    return advantages, advantages + values


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    num_tokens: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss (verl's `compute_value_loss`, TRL's): 0.5 x the token mean of
    max((V - R)^2, (clamp(V, V_old - clip, V_old + clip) - R)^2) over mask, and the share of tokens whose clipped
    term is the larger (detached). values [B, T] (with grad), old_values [B, T] (the critic's at the rollout),
    returns [B, T]; num_tokens: the divisor of the token mean (the global count over data-parallel ranks / their
    number), default the mask's count."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_loss, clipped_loss = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * _aggregate(torch.max(unclipped_loss, clipped_loss), mask, "token_mean", num_tokens)
    return loss, _masked_mean((clipped_loss > unclipped_loss).to(values.dtype), mask)


KL_ESTIMATORS = ("k1", "k3")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimates [B, T] of KL(policy || reference) from the sampled tokens' log-probs (J. Schulman,
    "Approximating KL divergence", 2020; verl's `kl_penalty`): k1 = logp - ref, unbiased and noisy; k3 =
    exp(ref - logp) - (ref - logp) - 1 (verl's `low_var_kl`, clamped as verl clamps it), never negative."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k3":
        log_ratio = (ref_logprobs - logprobs).clamp(-20, 20)
        return (log_ratio.exp() - log_ratio - 1).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator {estimator!r}; allowed: {', '.join(KL_ESTIMATORS)}")


class KLController:
    """The coefficient of a KL penalty: fixed (target None), or adapted to a target KL as Ziegler et al. 2019
    (arXiv:1909.08593) do, and verl's and TRL's `AdaptiveKLController`: after each rollout batch,
    value *= 1 + clip(kl / target - 1, -0.2, 0.2) x n_steps / horizon, kl the batch's KL estimate and n_steps its
    sequences, so the coefficient moves by at most 20% per horizon's worth of sequences."""

    def __init__(self, value: float, target: float | None = None, horizon: int = 10000):
        if target is not None and (target <= 0 or horizon <= 0):
            raise ValueError(f"an adaptive KL needs target > 0 and horizon > 0, got {target} and {horizon}")
        self.value, self.target, self.horizon = value, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.target is not None:
            error = min(max(current_kl / self.target - 1, -0.2), 0.2)
            self.value *= 1 + error * n_steps / self.horizon
