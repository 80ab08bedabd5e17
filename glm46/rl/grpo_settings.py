"""The GRPO settings of an RL phase (`phase.grpo`, conf/phase/rl.yaml): sampling, the policy loss and its updates,
dynamic sampling and temperature. GRPOLitModule and PPOLitModule (glm46.rl.grpo_module, glm46.rl.ppo_module) and
their rollout worker (glm46.rl.rollout_worker) read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from glm46.errors import ConfigError
from glm46.rl.core_algos import AGGREGATIONS
from glm46.rl.dynamic_temperature import TemperatureSettings


@dataclass
class GRPOSettings:
    """The GRPO settings of an RL phase (`phase.grpo`, conf/phase/rl.yaml), declared once: the phase's schema is this
    class, and GRPOLitModule takes it whole. Its own rules run when it is built (at composition, by the checks)."""

    samples_per_prompt: int = 16  # the group size
    max_new_tokens: int = 65536
    temperature: float = 1.0
    updates_per_rollout: int = 1  # optimizer updates per rollout batch and epoch, each on its share of the rows
    epochs: int = 1  # passes over each rollout batch (PPO's epochs); after the first, the rows in a seeded shuffle
    max_turns: int = 1  # > 1: multi-turn episodes, in which prompts that list tools call them (glm46.rl.episodes)
    max_turn_tokens: int | None = None  # each turn's bound in multi-turn episodes; None: max_new_tokens
    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # None: eps_clip
    eps_clip_c: float | None = None  # dual-clip PPO's bound on a negative advantage's loss (> 1); None: none
    scale_rewards: bool = True  # (r - mean) / (std + 1e-6); False: r - mean
    loss_aggregation: str = "token_mean"  # token_mean | seq_mean
    kl_coef: float = 0.0  # > 0: TRL's k3 KL term against the starting policy (init_from), held whole on each rank
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal, refill from the next prompts (DAPO)
    max_draws: int = 4  # dynamic sampling: rollout batches drawn per update at most, then flat groups fill the batch
    dynamic_temperature: TemperatureSettings = field(default_factory=TemperatureSettings)  # raised at a plateau

    def __post_init__(self):
        if self.loss_aggregation not in AGGREGATIONS:
            raise ConfigError(
                f"phase.grpo.loss_aggregation={self.loss_aggregation!r}: expected {' or '.join(AGGREGATIONS)}"
            )
        if self.kl_coef < 0:
            raise ConfigError(f"phase.grpo.kl_coef={self.kl_coef} must be >= 0 (0: no KL term, as GLM-4.5 trains)")
        if self.samples_per_prompt < 2 and self.scale_rewards:
            raise ConfigError(
                "phase.grpo.samples_per_prompt=1 leaves no group to normalise over: use >= 2 (GRPO's groups)"
            )
        if self.updates_per_rollout < 1 or self.epochs < 1:
            raise ConfigError(
                f"phase.grpo.updates_per_rollout={self.updates_per_rollout} and phase.grpo.epochs={self.epochs} "
                f"must be >= 1"
            )
        if self.eps_clip_c is not None and self.eps_clip_c <= 1:
            raise ConfigError(f"phase.grpo.eps_clip_c={self.eps_clip_c} must be > 1 (dual clip), or null")
        if self.max_turns < 1:
            raise ConfigError(f"phase.grpo.max_turns={self.max_turns} must be >= 1")
        if self.max_draws < 1:
            raise ConfigError(f"phase.grpo.max_draws={self.max_draws} must be >= 1 (rollout batches per update)")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            raise ConfigError(f"phase.grpo.max_turn_tokens={self.max_turn_tokens} must be >= 1 (or null)")
