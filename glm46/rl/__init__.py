"""Reinforcement learning and learning from preferences, as GLM-4.5 post-trains (arXiv:2508.06471 sections 3.2-3.4).

| file | what |
|---|---|
| core_algos.py | the math of RL steps: group advantages, GAE, token log-probs, policy and value losses, KL |
| preference_loss.py | the math of preference pairs: Bradley-Terry, DPO, IPO |
| grpo_module.py | GRPOLitModule: rollouts, rewards and the GRPO update as a LightningModule |
| ppo_module.py | PPOLitModule: GRPO's rollouts with a critic, GAE and the value loss |
| preference_module.py | what the modules that learn from pairs share (both sides in one forward) |
| reward_model.py, reward_export.py | the reward model's LightningModule, its export and loading |
| dpo_module.py | DPOLitModule: DPO and IPO with the reference log-probs computed once |
| rlhf.py | the RL reward mixed from the verifier and a reward model, and the monitor |
| score.py | task=score: a reward model's pairwise accuracy on prepared pairs |
| engine.py | the rollout engine's settings and client (vLLM) |
| prompts.py | PromptDataModule: chat prompts with a reference answer, from prepared shards |
| rewards.py | the verifier: the final integer of a reply against the reference |
"""

from .core_algos import AGGREGATIONS, group_advantages, policy_loss, token_logprobs

__all__ = ["AGGREGATIONS", "group_advantages", "policy_loss", "token_logprobs"]
