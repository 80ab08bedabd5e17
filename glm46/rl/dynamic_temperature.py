"""Dynamic temperature, as GLM-4.5 runs its RL (arXiv:2508.06471, section 3.2): once the mean reward stops rising,
the sampling temperature is raised, to explore more, but only as far as the held-out accuracy allows. The report takes
the highest temperature whose validation accuracy is within 1% of the best; here, of the current temperature's.

    phase.grpo.dynamic_temperature: {enabled: true, window: 20, min_gain: 0.01, candidates: [0.8, 1.0, 1.2],
                                     max_drop: 0.01, prompts: 64}

After every update GRPOLitModule asks `plateaued` of the mean rewards of its rollout batches: whether the last `window`
batches' mean rose less than `min_gain` over the `window` before. If so it samples `prompts` held-out prompts once at
the current temperature and at each higher candidate (the same seeds for each: a paired comparison), takes
`highest_within`, logs `rl/temperature`, and watches a fresh history. The temperature and the history are
checkpointed: a resumed run raises it where the uninterrupted one does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glm46.errors import ConfigError


@dataclass
class TemperatureSettings:
    """`phase.grpo.dynamic_temperature`: when and how far the sampling temperature rises."""

    enabled: bool = False
    window: int = 20  # rollout batches per window: the last window's mean reward against the one before
    min_gain: float = 0.01  # a rise below it is a plateau
    candidates: list[float] = field(default_factory=lambda: [0.8, 1.0, 1.2])  # the temperatures tried, ascending
    max_drop: float = 0.01  # the held-out accuracy may fall this share of the current temperature's, no more
    prompts: int = 64  # held-out prompts sampled per temperature

    def __post_init__(self):
        key = "phase.grpo.dynamic_temperature"
        if self.window < 1 or self.prompts < 1:
            raise ConfigError(f"{key}.window={self.window} and .prompts={self.prompts} must be >= 1")
        if not 0 <= self.max_drop < 1:
            raise ConfigError(f"{key}.max_drop={self.max_drop} must lie in [0, 1): a share of the held-out accuracy")
        candidates = list(self.candidates)
        if not candidates or candidates != sorted(set(candidates)) or candidates[0] <= 0:
            raise ConfigError(f"{key}.candidates={candidates} must be positive temperatures, ascending, each once")


def plateaued(rewards: list[float], window: int, min_gain: float) -> bool:
    """Whether the mean of the last `window` rewards rose less than `min_gain` over the mean of the `window` before."""
    if len(rewards) < 2 * window:
        return False
    last, before = rewards[-window:], rewards[-2 * window : -window]
    return sum(last) / window - sum(before) / window < min_gain


def highest_within(accuracies: dict[float, float], current: float, max_drop: float) -> float:
    """The highest temperature whose held-out accuracy is at least (1 - max_drop) x the current temperature's (which
    always is, so the temperature never falls)."""
    floor = accuracies[current] * (1 - max_drop)
    return max(t for t, accuracy in accuracies.items() if accuracy >= floor)
