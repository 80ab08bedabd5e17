"""Muon with AdamW groups in one torch.optim.Optimizer, the GLM-4.5 recipe.

Param groups with `use_muon=True` get Muon: momentum (Nesterov), Newton-Schulz orthogonalisation
per matrix, update scaled to RMS `update_rms` (`update_rms * sqrt(max(rows, cols))`, torch's
"match_rms_adamw"), decoupled weight decay. A 3-D parameter [E, rows, cols] is E matrices;
`row_chunks=2` splits each matrix's rows into separately orthogonalised blocks (the fused expert
gate/up projection is a gate and an up matrix). Other groups get AdamW with the same lr.
One optimizer object keeps Lightning's automatic optimisation, schedulers and checkpoints simple.

Under sharding (FSDP2, tensor or expert parallelism) parameters, gradients and the momentum are
DTensors holding a slice. Momentum and weight decay are elementwise and stay on the slice; the
Newton-Schulz step needs whole matrices, so the update is gathered over the mesh dims that split
matrix rows or columns (not those that split a stack of experts), orthogonalised, and each rank
keeps its own slice (Moonlight's distributed Muon): the result equals single-process Muon. A
slice made of whole matrices (experts sharded on the expert dim only) is orthogonalised in
place, without communication.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate

from .newton_schulz import orthogonalize


def splits_matrices(placement, ndim: int) -> bool:
    """Whether a placement of a tensor [..., rows, cols] cuts its matrices (Shard, _StridedShard: `.dim`)."""
    dim = getattr(placement, "dim", None)
    return dim is not None and dim % ndim >= ndim - 2


def _whole_matrix_placements(p: DTensor) -> list:
    """p's placements with every split of rows or columns undone: each rank then holds whole matrices."""
    return [Replicate() if splits_matrices(placement, p.ndim) else placement for placement in p.placements]


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
    ):
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
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["use_muon"]:
                    self._muon_update(p, group)
                else:
                    self._adamw_update(p, group)
        return loss

    def _muon_update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - group["momentum"])
        update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

        chunks = group["row_chunks"]
        rows, cols = p.shape[-2] // chunks, p.shape[-1]
        scale = group["update_rms"] * math.sqrt(max(rows, cols))
        if isinstance(update, DTensor):
            orthogonal = self._orthogonalize_sharded(update, group)
        else:
            orthogonal = self._orthogonalize(update, group)

        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(orthogonal.to(p.dtype), alpha=-group["lr"] * scale)

    @staticmethod
    def _orthogonalize(update: torch.Tensor, group: dict) -> torch.Tensor:
        """Newton-Schulz per matrix of update [..., rows, cols], each split into `row_chunks` row blocks."""
        chunks = group["row_chunks"]
        rows, cols = update.shape[-2] // chunks, update.shape[-1]
        matrices = update.reshape(-1, chunks, rows, cols)  # [matrices, chunks, rows, cols]
        dtype = group["ns_dtype"]
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return orthogonalize(matrices, group["ns_steps"], dtype).reshape(update.shape)

    def _orthogonalize_sharded(self, update: DTensor, group: dict) -> DTensor:
        whole = _whole_matrix_placements(update)
        gathered = update if whole == list(update.placements) else update.redistribute(update.device_mesh, whole)
        local = self._orthogonalize(gathered.to_local(), group)
        orthogonal = DTensor.from_local(
            local, update.device_mesh, whole, run_check=False, shape=update.shape, stride=update.stride()
        )
        return orthogonal.redistribute(update.device_mesh, update.placements)  # back to the slice: no communication

    def _adamw_update(self, p: torch.Tensor, group: dict) -> None:
        """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = state["step"].item()
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step

        p.mul_(1 - group["lr"] * group["weight_decay"])
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias_correction2)).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bias_correction1)
