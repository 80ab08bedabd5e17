"""Reinforcement learning: the loss of a GRPO step, as GLM-4.5 trains its RL stages (arXiv:2508.06471 section 3.2)."""

from .grpo import AGGREGATIONS, group_advantages, policy_loss, token_logprobs

__all__ = ["AGGREGATIONS", "group_advantages", "policy_loss", "token_logprobs"]
