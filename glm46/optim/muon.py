"""Muon with AdamW groups in one torch.optim.Optimizer, the GLM-4.5 recipe.

Param groups with `use_muon=True` get Muon: momentum (Nesterov), Newton-Schulz orthogonalisation
per matrix, update scaled to RMS `update_rms` (`update_rms * sqrt(max(rows, cols))`, torch's
"match_rms_adamw"), decoupled weight decay. A 3-D parameter [E, rows, cols] is E matrices;
`row_chunks=2` splits each matrix's rows into separately orthogonalised blocks (the fused expert
gate/up projection is a gate and an up matrix). Other groups get AdamW with the same lr.
One optimizer object keeps Lightning's automatic optimisation, schedulers and checkpoints simple.

Under sharding (FSDP2, tensor or expert parallelism) parameters, gradients and the momentum are
DTensors holding a slice. Momentum and weight decay are elementwise and stay on the slice; Newton-Schulz
needs whole matrices: glm46.optim.distributed_muon orthogonalises slices made of whole matrices where they
are and gives every split matrix one owner rank, so the work is divided, not repeated; the result
equals single-process Muon.
"""

from __future__ import annotations

import importlib
import math

import torch
from torch.optim.adam import adam

from glm46.parallel.boxes import local_tensor

from .distributed_muon import orthogonalize_updates
from .newton_schulz import BATCH_BYTES, NewtonSchulz


class Muon(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 2.5e-4,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: torch.dtype | str = torch.bfloat16,
        update_rms: float = 0.2,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        ns_batch_bytes: int = BATCH_BYTES,
    ):
        """ns_batch_bytes: the most fp32 update bytes one batched Newton-Schulz call (and, sharded, one owner's
        round) takes; its workspace is up to 6 times that (newton_schulz.workspace_bytes)."""
        if isinstance(ns_dtype, torch.dtype):  # kept as a name: checkpoints (DCP too) take plain values
            ns_dtype = str(ns_dtype).removeprefix("torch.")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            update_rms=update_rms,
            betas=tuple(betas),
            eps=eps,
            use_muon=False,
            row_chunks=1,
        )
        super().__init__(params, defaults)
        self.ns_batch_bytes = ns_batch_bytes
        for group in self.param_groups:
            if group["use_muon"]:
                bad = [tuple(p.shape) for p in group["params"] if p.ndim not in (2, 3)]
                if bad:
                    raise ValueError(f"Muon groups take 2-D matrices or 3-D stacks of them; got shapes {bad}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon = []  # (parameter, group, momentum update): orthogonalised together, collectively
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                muon += [(p, group, self._momentum_update(p, group)) for p in params]
            elif params:
                self._adamw_update(params, group)
        specs = [self._newton_schulz(group) for _, group, _ in muon]
        orthogonal = orthogonalize_updates([update for _, _, update in muon], specs, self.ns_batch_bytes)
        for (p, group, _), o in zip(muon, orthogonal):
            rows, cols = p.shape[-2] // group["row_chunks"], p.shape[-1]
            weights = local_tensor(p)  # a view: writes the parameter's slice
            weights.mul_(1 - group["lr"] * group["weight_decay"])
            weights.add_(o.to(p.dtype), alpha=-group["lr"] * group["update_rms"] * math.sqrt(max(rows, cols)))
        return loss

    def _momentum_update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """Momentum (Nesterov by default) of p's gradient, on p's slice."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - group["momentum"])
        return p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    @staticmethod
    def _newton_schulz(group: dict) -> NewtonSchulz:
        dtype = group["ns_dtype"]
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return NewtonSchulz(group["row_chunks"], group["ns_steps"], dtype)

    def _adamw_update(self, params: list[torch.Tensor], group: dict) -> None:
        """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments), run by torch's fused
        kernel: one pass over each tensor instead of a kernel per operation."""
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)  # the fused kernel's layout
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            elif state["step"].device != p.device:  # a checkpoint's step, loaded on the CPU
                state["step"] = state["step"].to(p.device)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam(  # elementwise, so on each tensor's local slice when sharded
            [local_tensor(p) for p in params],
            [local_tensor(p.grad) for p in params],
            [local_tensor(s["exp_avg"]) for s in states],
            [local_tensor(s["exp_avg_sq"]) for s in states],
            [],
            [s["step"] for s in states],
            fused=True,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def is_muon(target: str) -> bool:
    """Whether the optimizer `_target_` names glm46's Muon (or a subclass); False when it cannot be imported."""
    module, _, name = target.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name, None) if module else None
    except ImportError:
        return False
    return isinstance(found, type) and issubclass(found, Muon)
