"""Schedules driven by tokens, so they survive a change of batch size or a resume on other hardware.

Each is a small callable `schedule(tokens) -> value`, built from config with `_target_`. The LR schedules return a
factor of the optimizer's LR, as torchtitan's do: the LR is stated once, in the optimizer, and `LambdaLR` multiplies.
The tokens are those of the recipe's clock (the `recipe` config group): pre-training and mid-training phases are one
run of the schedules, each phase starting where the phases before it end (GLM-4.5 runs one LR warm-up and one cosine
"until the end of mid-training", and switches the MTP weight and the balancer rate once, at 15T tokens).
`recipe_values` gives the values the trainer uses at a point of a composed config's phase.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from hydra.utils import instantiate
from omegaconf import DictConfig

from glm46.errors import ConfigError


def check_factors(min_factor: float, scale: float) -> None:
    """The LR schedules' own rule on their factors (glm46.config.checks runs it at composition, naming the keys)."""
    if not 0 <= min_factor <= 1:
        raise ConfigError(f"schedule.lr.min_factor={min_factor!r} must be in [0, 1]: the floor as a share of the peak")
    if not scale > 0:
        raise ConfigError(f"schedule.lr.scale={scale!r} (phase.lr_scale) must be > 0")


@dataclass
class WarmupCosine:
    """LR factor: linear warm-up 0 -> 1 over warmup_tokens, cosine decay to min_factor at total_tokens, then
    min_factor; all times `scale` (a stage's share of the optimizer's LR). GLM-4.5: 0 -> 2.5e-4 -> 2.5e-5, i.e.
    min_factor 0.1 of the optimizer's 2.5e-4."""

    warmup_tokens: int
    total_tokens: int
    min_factor: float = 0.0
    scale: float = 1.0

    def __post_init__(self):
        check_factors(self.min_factor, self.scale)

    def __call__(self, tokens: int) -> float:
        if tokens < self.warmup_tokens:
            return self.scale * tokens / self.warmup_tokens
        progress = min(1.0, (tokens - self.warmup_tokens) / max(1, self.total_tokens - self.warmup_tokens))
        return self.scale * (self.min_factor + 0.5 * (1 - self.min_factor) * (1 + math.cos(math.pi * progress)))


@dataclass
class WarmupStableDecay:
    """LR factor of WSD: linear warm-up to 1, constant, then linear decay to min_factor over the last decay_tokens;
    all times `scale`."""

    warmup_tokens: int
    total_tokens: int
    decay_tokens: int
    min_factor: float = 0.0
    scale: float = 1.0

    def __post_init__(self):
        check_factors(self.min_factor, self.scale)

    def __call__(self, tokens: int) -> float:
        if tokens < self.warmup_tokens:
            return self.scale * tokens / self.warmup_tokens
        decay_start = self.total_tokens - self.decay_tokens
        if tokens < decay_start:
            return self.scale
        progress = min(1.0, (tokens - decay_start) / max(1, self.decay_tokens))
        return self.scale * (1 + (self.min_factor - 1) * progress)


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


def next_accumulation(micro_batches_done: int, current: int, wanted: int) -> int:
    """The gradient accumulation of the optimizer step that starts after `micro_batches_done` micro-batches.

    Lightning steps when (micro-batches this epoch) % accumulate_grad_batches == 0, so a new accumulation takes
    effect only where a whole cycle of its length starts; until then the current one goes on. Every step thus
    sums exactly the micro-batches it claims (glm46.lit.callbacks.BatchSizeWarmup applies this rule)."""
    return wanted if micro_batches_done % wanted == 0 else current


def accumulation_for(tokens_per_step: Callable[[int], float], recipe_tokens: int, micro_batch_tokens: int) -> int:
    """Micro-batches per optimizer step that come nearest to the global batch `tokens_per_step` asks for."""
    return max(1, round(tokens_per_step(recipe_tokens) / micro_batch_tokens))


def batch_warmup_steps(
    ramp: LinearRamp, start_tokens: int, micro_batch_tokens: int, initial: int
) -> Iterator[tuple[int, int]]:
    """(tokens into the run, accumulation) of each optimizer step of a run that starts at `start_tokens` on the
    recipe's clock with accumulate_grad_batches=`initial`, as the batch-size warm-up decides them. It ends with the
    first step from which the accumulation stays what it is (past the ramp, at the ramp's end)."""
    final = accumulation_for(ramp, ramp.ramp_tokens, micro_batch_tokens)
    done, current, tokens = 0, initial, 0
    while True:
        current = next_accumulation(done, current, accumulation_for(ramp, start_tokens + tokens, micro_batch_tokens))
        yield tokens, current
        if start_tokens + tokens >= ramp.ramp_tokens and current == final:
            return
        done += current
        tokens += current * micro_batch_tokens


def steps_for(budget: int, ramp: LinearRamp | None, start_tokens: int, micro_batch_tokens: int, initial: int) -> int:
    """Optimizer steps that spend `budget` tokens (the last step may pass it by less than one global batch): with
    the batch-size warm-up's growing steps when there is one, else `initial` micro-batches each."""
    if ramp is None:
        return math.ceil(budget / (initial * micro_batch_tokens))
    for step, (tokens, _) in enumerate(batch_warmup_steps(ramp, start_tokens, micro_batch_tokens, initial)):
        if tokens >= budget:
            return step
    # the last step yielded is the first at the ramp's end: it and the ones after it take the final accumulation
    final = accumulation_for(ramp, ramp.ramp_tokens, micro_batch_tokens)
    return step + math.ceil((budget - tokens) / (final * micro_batch_tokens))


def recipe_values(cfg: DictConfig, tokens_into_phase: int) -> dict[str, float]:
    """The values the trainer uses for the composed config `cfg` once it has seen `tokens_into_phase` tokens of its
    phase: `lr` (the optimizer's LR times the schedule's factor), `global_batch_tokens` (under the batch-size
    warm-up, the global batch of the step that starts there), `mtp_weight` and `balancer_rate`. The schedules read
    the recipe's tokens: the phase's start on the clock (`schedule.start_tokens`) plus `tokens_into_phase`."""
    start = cfg.schedule.start_tokens
    callbacks = cfg.get("callbacks") or {}
    balancer, warmup = callbacks.get("expert_balancer"), callbacks.get("batch_size_warmup")
    global_batch = cfg.global_batch_tokens
    if warmup is not None:
        initial = cfg.trainer.accumulate_grad_batches
        micro_batch_tokens = global_batch // initial
        for tokens, accumulation in batch_warmup_steps(
            instantiate(warmup.tokens_per_step), start, micro_batch_tokens, initial
        ):
            if tokens > tokens_into_phase:
                break
            global_batch = accumulation * micro_batch_tokens
    recipe_tokens = start + tokens_into_phase
    return {
        "lr": cfg.optim.optimizer.lr * instantiate(cfg.schedule.lr)(recipe_tokens),
        "global_batch_tokens": global_batch,
        "mtp_weight": instantiate(cfg.schedule.mtp_weight)(recipe_tokens),
        "balancer_rate": instantiate(balancer.rate)(recipe_tokens) if balancer is not None else 0.0,
    }
