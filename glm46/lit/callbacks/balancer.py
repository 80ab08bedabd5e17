"""Loss-free expert balancing (Wang et al. 2024; DeepSeek-V3; GLM-4.5), as a Lightning callback.

Expert token counts accumulate over the micro-batches of an optimizer step; before the step they
are summed over data-parallel ranks, and each MoE layer's `e_score_correction_bias` moves by
`u * sign(mean - count)` (rule "sign"), or `u * (mean - count) / mean` (rule "proportional"),
with u = rate(the recipe's tokens, pl_module.recipe_tokens). Every rank applies the same update because it sees
the same counts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning as L
import numpy as np
import torch

from glm46.parallel.data_parallel import data_parallel_group


def max_violation(counts: torch.Tensor) -> torch.Tensor:
    """MaxVio = (max load - mean load) / mean load, per layer. counts [layers, E] -> [layers]."""
    counts = counts.float()
    mean = counts.mean(dim=-1)
    return (counts.max(dim=-1).values - mean) / mean.clamp(min=1e-9)


class ExpertBalancer(L.Callback):
    def __init__(
        self,
        rate: Callable[[int], float],
        rule: str = "sign",
        history_every: int = 10,
        history_file: str | None = "expert_load.npz",
    ):
        if rule not in ("sign", "proportional"):
            raise ValueError(f"rule={rule!r}: expected 'sign' or 'proportional'")
        self.rate, self.rule = rate, rule
        self.history_every, self.history_file = history_every, history_file
        self.pending: torch.Tensor | None = None  # counts of the optimizer step in progress
        self.history: list[tuple[int, torch.Tensor]] = []  # (step, counts [layers, E]) for the plots

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        counts = pl_module.latest_expert_counts
        if counts is not None:
            self.pending = counts.clone() if self.pending is None else self.pending + counts

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if self.pending is None:
            return
        if getattr(pl_module, "skipping_step", False):  # the step guard dropped this step: no update
            self.pending = None
            return
        # The global batch: summed over the data-parallel ranks (tensor-parallel ranks share a batch;
        # expert-parallel ranks count their own tokens before dispatch, so they are data-parallel here).
        group = data_parallel_group(trainer.strategy)
        counts = trainer.strategy.reduce(self.pending.float(), group=group, reduce_op="sum")
        self.pending = None
        rate = self.rate(pl_module.recipe_tokens)
        mean = counts.mean(dim=-1, keepdim=True)
        error = mean - counts
        step = error.sign() if self.rule == "sign" else error / mean.clamp(min=1e-9)
        moves = getattr(pl_module, "moves_routing_bias", True)  # adapters on a frozen base keep routing frozen
        with torch.no_grad():
            for router, delta in zip(pl_module.model.routers() if moves else [], step):
                router.e_score_correction_bias.add_(rate * delta.to(router.e_score_correction_bias.device))

        model_step = getattr(pl_module, "model_step", None)
        if model_step is not None:  # this rank's layers -> every pipeline stage's, for the logs and the plots
            counts = model_step.whole_model_rows(counts)
        violation = max_violation(counts)
        pl_module.log("moe/maxvio", violation.mean(), prog_bar=True)
        for layer, value in enumerate(violation):
            pl_module.log(f"moe/maxvio_layer{layer}", value)
        pl_module.log("moe/bias_rate", rate)
        if trainer.global_step % self.history_every == 0:
            self.history.append((trainer.global_step, counts.cpu()))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        log_dir = trainer.log_dir  # a broadcast under multi-process strategies: every rank must ask
        if self.history_file and self.history and trainer.is_global_zero and log_dir:
            steps, counts = zip(*self.history)
            np.savez(Path(log_dir) / self.history_file, steps=np.array(steps), counts=torch.stack(counts).numpy())

    def state_dict(self) -> dict:
        return {"pending": self.pending, "history": self.history}

    def load_state_dict(self, state_dict: dict) -> None:
        self.pending = state_dict["pending"]
        self.history = list(state_dict["history"])
