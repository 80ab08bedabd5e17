"""Dynamic temperature, as GLM-4.5 runs its RL (arXiv:2508.06471, section 3.2): once the mean reward stops rising,
the sampling temperature is raised, to explore more, but only as far as the held-out accuracy allows. The report takes
the highest temperature whose validation accuracy is within 1% of the best; here, of the current temperature's.

    phase.grpo.dynamic_temperature: {enabled: true, window: 20, min_gain: 0.01, candidates: [0.8, 1.0, 1.2],
                                     max_drop: 0.01, prompts: 64}

After every update GRPOLitModule's DynamicTemperature asks `plateaued` of the mean rewards of its rollout batches:
whether the last `window` batches' mean rose less than `min_gain` over the `window` before. If so the module samples
`prompts` held-out prompts once at the current temperature and at each higher candidate (the same seeds for each: a
paired comparison), `highest_within` is taken, `rl/temperature` logged, and a fresh history watched. The temperature
and the history are checkpointed: a resumed run raises it where the uninterrupted one does.
"""

from __future__ import annotations

from collections.abc import Callable
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


class DynamicTemperature:
    """An RL run's sampling temperature and the rewards it watches. Each rollout batch's mean reward is `drawn`, and
    joins the history at the update that trains on it (`at_update`: dynamic sampling may draw several batches per
    update); `adjust` then takes, at a plateau, the highest candidate whose held-out accuracy (`probe(temperature)`)
    holds. Without `settings.enabled` the temperature stays."""

    def __init__(self, settings: TemperatureSettings, temperature: float):
        self.settings, self.value = settings, temperature
        self.history: list[float] = []  # each rollout batch's mean reward since the last plateau's probe
        self.drawn: list[float] = []  # those since the last update

    def at_update(self) -> None:
        self.history, self.drawn = self.history + self.drawn, []

    def adjust(self, probe: Callable[[float], float]) -> dict[float, float] | None:
        """At a plateau: the held-out accuracy of each temperature tried (the new value taken); else None."""
        settings = self.settings
        if not settings.enabled or not plateaued(self.history, settings.window, settings.min_gain):
            return None
        tried = [self.value] + [t for t in settings.candidates if t > self.value]
        accuracies = {t: probe(t) for t in tried}
        self.value, self.history = highest_within(accuracies, self.value, settings.max_drop), []
        return accuracies

    def state_dict(self) -> dict:
        return {"temperature": self.value, "reward_history": self.history}

    def load_state_dict(self, state: dict, default: float) -> None:
        self.value, self.history = state.get("temperature", default), state.get("reward_history", [])
