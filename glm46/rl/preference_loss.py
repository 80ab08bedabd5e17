"""The math of learning from preference pairs: a reward model's Bradley-Terry loss and DPO's losses.

Each pair has a chosen and a rejected reply to one prompt. A reward model scores both and learns
P(chosen > rejected) = sigmoid(r_chosen - r_rejected) (Bradley-Terry; InstructGPT, arXiv:2203.02155), with TRL's
RewardTrainer's options: a margin subtracted inside the sigmoid (Llama 2, arXiv:2307.09288) and a penalty
`center_coef * mean((r_chosen + r_rejected)^2)` that keeps rewards centred on 0 (arXiv:2312.09244). DPO
(arXiv:2305.18290) trains the policy on the pairs directly, with the log-ratios to a frozen reference as implicit
rewards; IPO (arXiv:2310.12036) regresses their difference, per reply token as TRL computes it, to 1 / (2 beta).
Either can add the chosen replies' negative log-likelihood per token (RPO, arXiv:2404.19733; TRL's loss_type
[..., "sft"]): DPO's loss does not depend on the tokens both replies open with (the chat format's `<think></think>`),
so nothing else holds them while the rest moves. tests/test_preference_loss.py checks each against TRL's
RewardTrainer.compute_loss and DPOTrainer._compute_loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DPO_LOSSES = ("sigmoid", "ipo")


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | float | None = None,
    center_coef: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-mean(logsigmoid(r_chosen - r_rejected - margin)) (+ center_coef * mean((r_chosen + r_rejected)^2)) of the
    rewards [B] of each side, and the statistics (detached): `accuracy` (the share of pairs ranked right) and
    `margin` (the mean of r_chosen - r_rejected)."""
    difference = chosen.float() - rejected.float()
    loss = -F.logsigmoid(difference - (0.0 if margin is None else margin)).mean()
    if center_coef:
        loss = loss + center_coef * ((chosen.float() + rejected.float()) ** 2).mean()
    stats = {"accuracy": (difference > 0).float().mean().detach(), "margin": difference.mean().detach()}
    return loss, stats


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's log-prob [B]: the sum of its token log-probs [B, T] over mask [B, T] (its reply tokens)."""
    return (token_logprobs * mask).sum(dim=1)


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
    sft_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO's loss over a batch of pairs, from each reply's summed log-prob [B] under the policy and the reference.

    sigmoid: -logsigmoid(beta * (chosen log-ratio - rejected log-ratio)), DPO's; ipo: (the same difference with each
    log-ratio divided by its reply's token count (`*_tokens` [B]) - 1 / (2 beta))^2; plus `sft_weight` x the chosen
    replies' negative log-likelihood per token over the batch (TRL's "sft" loss with that weight). The statistics
    (detached), as TRL logs them: `rewards/chosen` and `rewards/rejected` (beta * log-ratio, the implicit rewards),
    `rewards/accuracies` (the share of pairs whose chosen reward is higher) and `rewards/margins` (their mean
    difference)."""
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"loss_type={loss_type!r}: expected one of {', '.join(DPO_LOSSES)}")
    chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    counted = chosen_tokens is not None and (loss_type != "ipo" or rejected_tokens is not None)
    if (loss_type == "ipo" or sft_weight) and not counted:
        raise ValueError(f"loss_type={loss_type!r} with sft_weight={sft_weight} needs each reply's token count")
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    else:
        per_token = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (per_token - 1 / (2 * beta)) ** 2
    chosen_rewards, rejected_rewards = (beta * ratio.detach() for ratio in (chosen_ratio, rejected_ratio))
    stats = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
    }
    loss = losses.mean()
    if sft_weight:
        loss = loss - sft_weight * chosen_logps.sum() / chosen_tokens.sum().clamp(min=1)
    return loss, stats
