"""Reinforcement learning on verifiable answers, as GLM-4.5 trains its RL stages (arXiv:2508.06471 section 3.2).

| file | what |
|---|---|
| core_algos.py | the math of a GRPO step: group-normalised advantages, per-token log-probs, the clipped policy loss |
| grpo_module.py | GRPOLitModule: rollouts, rewards and the GRPO update as a LightningModule |
| prompts.py | PromptDataModule: chat prompts with a reference answer, from prepared shards |
| rewards.py | the reward: the final integer of a reply against the reference |
"""

from .core_algos import AGGREGATIONS, group_advantages, policy_loss, token_logprobs

__all__ = ["AGGREGATIONS", "group_advantages", "policy_loss", "token_logprobs"]
