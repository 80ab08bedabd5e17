"""Schedules driven by tokens seen, so they survive a change of batch size or a resume on other hardware.

Each is a small callable `schedule(tokens) -> value`, built from config with `_target_`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class WarmupCosine:
    """Linear warm-up 0 -> peak over warmup_tokens, cosine decay to floor at total_tokens, then floor.
    GLM-4.5: 0 -> 2.5e-4 -> 2.5e-5."""

    peak: float
    floor: float
    warmup_tokens: int
    total_tokens: int

    def __call__(self, tokens: int) -> float:
        if tokens < self.warmup_tokens:
            return self.peak * tokens / self.warmup_tokens
        progress = min(1.0, (tokens - self.warmup_tokens) / max(1, self.total_tokens - self.warmup_tokens))
        return self.floor + 0.5 * (self.peak - self.floor) * (1 + math.cos(math.pi * progress))


@dataclass
class WarmupStableDecay:
    """WSD: linear warm-up, constant peak, then linear decay to floor over the last decay_tokens."""

    peak: float
    floor: float
    warmup_tokens: int
    total_tokens: int
    decay_tokens: int

    def __call__(self, tokens: int) -> float:
        if tokens < self.warmup_tokens:
            return self.peak * tokens / self.warmup_tokens
        decay_start = self.total_tokens - self.decay_tokens
        if tokens < decay_start:
            return self.peak
        progress = min(1.0, (tokens - decay_start) / max(1, self.decay_tokens))
        return self.peak + (self.floor - self.peak) * progress


@dataclass
class Piecewise:
    """values[i] until boundaries[i] tokens, values[-1] after the last boundary.
    GLM-4.5: MTP weight 0.3 then 0.1, balancer rate 0.001 then 0, both switching at 15T tokens."""

    values: list[float]
    boundaries: list[int]

    def __post_init__(self):
        if len(self.values) != len(self.boundaries) + 1:
            raise ValueError(
                f"Piecewise needs one more value than boundaries: values={self.values}, boundaries={self.boundaries}"
            )
        if list(self.boundaries) != sorted(self.boundaries):
            raise ValueError(f"Piecewise boundaries must be increasing: {self.boundaries}")

    def __call__(self, tokens: int) -> float:
        for value, boundary in zip(self.values, self.boundaries):
            if tokens < boundary:
                return value
        return self.values[-1]


@dataclass
class LinearRamp:
    """start -> end linearly over ramp_tokens, then end. GLM-4.5's batch size: 16M -> 64M tokens over 500B."""

    start: float
    end: float
    ramp_tokens: int

    def __call__(self, tokens: int) -> float:
        return self.start + (self.end - self.start) * min(1.0, tokens / max(1, self.ramp_tokens))
