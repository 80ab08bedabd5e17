"""The step guard: skip optimizer steps whose loss or gradient is bad; roll back when they keep coming.

A step is bad when its loss or gradient norm is not finite, or, once `warmup_steps` good steps have set a
running average, when its loss exceeds `spike_factor` x that average. A bad step changes nothing: the
module drops its gradients (the optimizers skip parameters without one) and the balancer its expert counts.
After `max_bad_steps` bad steps in a row the module restores the newest checkpoint's weights and optimizer
state and goes on with the batches after the bad ones: the token counter and the data position are kept,
so the batches since the checkpoint are not replayed (PaLM's remedy for loss spikes). `on_repeated: stop`,
or more than `max_rollbacks` rollbacks, stops the run with TrainingDiverged instead.
"""

from __future__ import annotations

import math


class TrainingDiverged(RuntimeError):
    pass


class StepGuard:
    def __init__(
        self,
        spike_factor: float = 3.0,
        warmup_steps: int = 20,
        ema_decay: float = 0.95,
        max_bad_steps: int = 3,
        on_repeated: str = "rollback",
        max_rollbacks: int = 3,
    ):
        if on_repeated not in ("rollback", "stop"):
            raise ValueError(f"guard.on_repeated={on_repeated!r}: expected 'rollback' or 'stop'")
        if spike_factor <= 1 or not 0 <= ema_decay < 1 or max_bad_steps < 1:
            raise ValueError(
                f"guard: spike_factor={spike_factor} must be > 1, ema_decay={ema_decay} in [0, 1), "
                f"max_bad_steps={max_bad_steps} >= 1"
            )
        self.spike_factor, self.warmup_steps, self.ema_decay = spike_factor, warmup_steps, ema_decay
        self.max_bad_steps, self.on_repeated, self.max_rollbacks = max_bad_steps, on_repeated, max_rollbacks
        self.running_loss: float | None = None  # exponential average of good steps' losses
        self.good_steps = 0
        self.bad_in_a_row = 0
        self.skipped = 0
        self.rollbacks = 0

    def judge(self, loss: float, grad_norm: float) -> str | None:
        """Why this step is bad, or None: then it is good and its loss joins the running average."""
        if not math.isfinite(loss):
            reason = f"non-finite loss {loss}"
        elif not math.isfinite(grad_norm):
            reason = f"non-finite gradient norm {grad_norm}"
        elif self.good_steps >= self.warmup_steps and loss > self.spike_factor * self.running_loss:
            reason = f"loss spike {loss:.4g} > {self.spike_factor} x running average {self.running_loss:.4g}"
        else:
            self.running_loss = (
                loss
                if self.running_loss is None
                else (self.ema_decay * self.running_loss + (1 - self.ema_decay) * loss)
            )
            self.good_steps += 1
            self.bad_in_a_row = 0
            return None
        self.bad_in_a_row += 1
        self.skipped += 1
        return reason

    @property
    def must_act(self) -> bool:
        """Bad steps keep coming: roll back (or stop)."""
        return self.bad_in_a_row >= self.max_bad_steps

    def rolled_back(self) -> None:
        self.bad_in_a_row = 0
        self.rollbacks += 1

    def state_dict(self) -> dict:
        return {
            key: getattr(self, key) for key in ("running_loss", "good_steps", "bad_in_a_row", "skipped", "rollbacks")
        }

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
