"""95% intervals of the skills a run measures: an accuracy on n samples (Wilson's), and the change of an accuracy
between two models on the same samples (paired)."""

from __future__ import annotations

import math


def interval(accuracy: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of an accuracy measured on n samples (sound near 0 and 1, unlike p +- z SE)."""
    n = max(n, 1)
    center = (accuracy + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n))
    return max(center - half, 0.0), min(center + half, 1.0)  # clamped: at 0 or 1 rounding may step past them


def paired_change(before: dict[int, float], after: dict[int, float], z: float = 1.96) -> tuple[float, float, float]:
    """The change in accuracy on the same prompts, with the 95% interval of a paired difference (the prompts both
    stages got right or wrong cancel; only the ones that changed count): (change, low, high)."""
    shared = sorted(before.keys() & after.keys())
    n = max(len(shared), 1)
    gained = sum(after[i] > before[i] for i in shared)
    lost = sum(after[i] < before[i] for i in shared)
    change = (gained - lost) / n
    half = z * math.sqrt(max(gained + lost - (gained - lost) ** 2 / n, 0.0)) / n
    return change, change - half, change + half
