"""What a training checkpoint holds beside the weights, and the surgery a resume under other conditions needs:
the random generators' states, optimizer states keyed by parameter name, and the gradient-accumulation counters.
GLM46LitModule's checkpoint hooks call these; a resume then continues bit for bit, under another layout too.
"""

from __future__ import annotations

import random

import lightning as L
import numpy as np
import torch
from lightning.pytorch.strategies import ModelParallelStrategy


def rng_states() -> dict:
    """Python's, numpy's, torch's and CUDA's generator states, as tensors and numbers (`weights_only` loads them)."""
    name, keys, position, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.copy()), position, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_states(saved: dict) -> None:
    random.setstate(saved["python"])
    name, keys, position, has_gauss, gauss = saved["numpy"]
    np.random.set_state((name, keys.numpy(), position, has_gauss, gauss))
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])


def key_optimizer_states_by_name(checkpoint: dict, trainer: L.Trainer, module: torch.nn.Module) -> None:
    """Full optimizer states come keyed by position: in the optimizer's order (torch), or, under the mesh
    strategy, in the module's parameter order (Lightning). Neither order survives a change of engine (Muon's
    groups list matrices first; Lightning's mesh loader assumes the module's order), so both become parameter
    names, each group listing its names in the optimizer's order: torch's `Optimizer.load_state_dict` matches
    them by position within the groups, Lightning's mesh loader by name. Sharded (DCP) states are keyed by name
    already."""
    names = {p: name for name, p in module.named_parameters()}
    for optimizer, state in zip(trainer.optimizers, checkpoint.get("optimizer_states", [])):
        if not state.get("state") or not all(isinstance(key, int) for key in state["state"]):
            continue
        if isinstance(trainer.strategy, ModelParallelStrategy):
            order = list(module.parameters())
        else:
            order = [p for group in optimizer.param_groups for p in group["params"]]
        state["state"] = {names[order[key]]: value for key, value in state["state"].items()}
        for saved, group in zip(state["param_groups"], optimizer.param_groups):
            saved["params"] = [names[p] for p in group["params"]]


def align_accumulation(checkpoint: dict, trainer: L.Trainer) -> None:
    """A resume with another gradient accumulation (the same global batch on another number of data-parallel
    ranks): Lightning steps when (batches this epoch) % accumulate_grad_batches == 0, so the epoch's batch
    counters move up to the next multiple of the new accumulation, and the first step after the resume sums a
    whole cycle. Data positions count samples, not these counters (glm46.lit.shard_data).

    When a callback owns the accumulation (`owns_accumulation`: the batch-size warm-up moves it with the recipe's
    tokens), the resume takes the one the checkpoint was written with, so that the run goes on as if
    uninterrupted; the callback then moves it again."""
    if (
        any(getattr(c, "owns_accumulation", False) for c in trainer.callbacks)
        and "accumulate_grad_batches" in checkpoint
    ):
        trainer.accumulate_grad_batches = checkpoint["accumulate_grad_batches"]
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    shift = -progress["current"]["ready"] % trainer.accumulate_grad_batches
    for counters in (progress["current"], progress["total"]):
        for key in counters:
            counters[key] += shift
