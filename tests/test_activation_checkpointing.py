"""Activation checkpointing (glm46.parallel.checkpointing): full and selective give the gradients of no
checkpointing; full runs every forward matmul again in backward, selective none (it keeps their outputs); the plan's
activations shrink from none to selective to full; a mode that does not exist is refused naming the key."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glm46.modules.model import total_loss
from glm46.parallel.checkpointing import apply_activation_checkpointing
from glm46.parallel.layout import Layout
from glm46.planning.plan import stage_memory

from .helpers import random_model, relative_error, tiny_config

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten._grouped_mm.default}


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def _backward(mode: str | None) -> tuple[torch.nn.Module, int]:
    """Gradients of a tiny model (MTP on) with `mode`, and the matmuls dispatched in backward."""
    model = copy.deepcopy(random_model(tiny_config()))
    if mode:
        apply_activation_checkpointing(model, mode)
    x = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = total_loss(model(x, labels=x.roll(-1, dims=1)), 0.3, 1e-4)
    with CountOps() as counted:
        loss.backward()
    return model, sum(counted.ops[op] for op in MATMULS)


def test_full_and_selective_give_the_same_gradients_and_selective_recomputes_no_matmul():
    plain, matmuls = _backward(None)
    full, matmuls_full = _backward("full")
    selective, matmuls_selective = _backward("selective")
    for (name, a), b, c in zip(plain.named_parameters(), full.parameters(), selective.parameters()):
        assert relative_error(b.grad, a.grad) < 1e-6 and relative_error(c.grad, a.grad) < 1e-6, name
    assert matmuls_selective == matmuls < matmuls_full  # full: the forward's matmuls again
    assert list(selective.state_dict()) == list(plain.state_dict())  # in place: the same keys


def test_a_mode_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match=r"activation_checkpointing_mode=partial: one of full, selective"):
        apply_activation_checkpointing(random_model(tiny_config()), "partial")


def test_the_plan_counts_less_activation_memory_from_none_to_selective_to_full():
    config = tiny_config(num_hidden_layers=4)
    modes = (None, "selective", "full")
    memory = {mode: stage_memory(config, Layout(1), 4096, "adamw", mode, None)["activations"] for mode in modes}
    assert memory[None] > memory["selective"] > memory["full"]
