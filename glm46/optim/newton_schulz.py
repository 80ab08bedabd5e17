"""Quintic Newton-Schulz orthogonalisation (Keller Jordan's Muon), batched over leading dimensions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7
BATCH_BYTES = 1 << 30  # the most update bytes one batched call takes by default (Muon's ns_batch_bytes)


def orthogonalize(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximately U V^T of each matrix in g [..., rows, cols], in `dtype`, as torch.optim.Muon computes it.

    A stack [E, rows, cols] (the routed experts) is orthogonalised per matrix in one batched call.
    """
    return orthogonalize_stacks([g.reshape(-1, *g.shape[-2:])], steps, dtype).reshape(g.shape)


def orthogonalize_stacks(stacks: list[torch.Tensor], steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Stacks [k_i, rows, cols] of one shape -> their matrices orthogonalised, as one batch [sum k_i, rows, cols]
    in `dtype`, with torch.optim.Muon's arithmetic (a tall matrix is iterated transposed, so the Gram is the small
    side). The iteration runs in four buffers allocated once (iterate, successor, Gram, polynomial): new tensors
    per step would be fresh pages for the kernel to fault in and zero, which on a CPU cost as much as the copies."""
    a, b, c = COEFFICIENTS
    rows, cols = stacks[0].shape[-2:]
    tall = rows > cols
    m, n = (cols, rows) if tall else (rows, cols)
    x = torch.empty(sum(len(s) for s in stacks), m, n, dtype=dtype, device=stacks[0].device)
    start = 0
    for stack in stacks:  # normalised straight into the batch: no concatenated copy first
        piece = stack.to(dtype)
        piece = piece.mT if tall else piece
        torch.div(piece, piece.norm(dim=(-2, -1), keepdim=True).clamp(min=EPS), out=x[start : start + len(stack)])
        start += len(stack)
    successor, gram, poly = torch.empty_like(x), x.new_empty(len(x), m, m), x.new_empty(len(x), m, m)
    for _ in range(steps):
        torch.bmm(x, x.mT, out=gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)  # b * A + c * A @ A
        torch.baddbmm(x, poly, x, beta=a, out=successor)  # a * X + (b * A + c * A @ A) @ X
        x, successor = successor, x
    return x.mT if tall else x


def newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> int:
    """FLOPs of `orthogonalize` on one [rows, cols] matrix: per step, with m = min and n = max of the two,
    the gram X X^T (2 m^2 n), A @ A (2 m^3) and the product with X (2 m^2 n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def workspace_bytes(batch_bytes: int, dtype: torch.dtype) -> int:
    """The most memory one batched call holds beside the fp32 updates it reads, for `batch_bytes` of them: the whole
    matrices an owner rank receives (fp32), the four iteration buffers of orthogonalize_stacks in `dtype` (Gram
    and polynomial are at most the batch's size), and the result cast back (fp32). 6x the batch in fp32, 4x in bf16."""
    elements = batch_bytes // 4
    return 4 * elements + 4 * elements * dtype.itemsize + 4 * elements


@dataclass(frozen=True)
class NewtonSchulz:
    """How one parameter's update is orthogonalised: a tensor [..., rows, cols] is a stack of matrices, each
    cut into `row_chunks` row blocks that are orthogonalised separately (the fused expert gate/up)."""

    row_chunks: int = 1
    steps: int = 5
    dtype: torch.dtype = torch.bfloat16

    def matrix_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return shape[-2] // self.row_chunks, shape[-1]

    def flops(self, shape: tuple[int, ...]) -> int:
        rows, cols = self.matrix_shape(shape)
        count = self.row_chunks * (int(torch.Size(shape[:-2]).numel()) if len(shape) > 2 else 1)
        return count * newton_schulz_flops(rows, cols, self.steps)


def consecutive_within(sizes: list[int], budget: int) -> list[list[int]]:
    """Indices of `sizes` in runs of consecutive items summing to at most `budget` (an item over it alone)."""
    runs, current, total = [], [], 0
    for i, size in enumerate(sizes):
        if current and total + size > budget:
            runs.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    return runs + [current] if current else runs


def orthogonalize_batched(
    updates: list[torch.Tensor], specs: list[NewtonSchulz], max_bytes: int = BATCH_BYTES
) -> list[torch.Tensor]:
    """Each update orthogonalised per its spec, in the update's dtype. Matrices of the same shape and spec
    (the q_proj of every layer, every expert stack) go through batched calls of at most `max_bytes` of updates."""
    batches: dict[tuple, list[int]] = {}
    for i, (update, spec) in enumerate(zip(updates, specs)):
        batches.setdefault((spec, spec.matrix_shape(update.shape)), []).append(i)
    results: list[torch.Tensor | None] = [None] * len(updates)
    for (spec, (rows, cols)), same in batches.items():
        for run in consecutive_within([updates[i].nbytes for i in same], max_bytes):
            indices = [same[r] for r in run]
            stacks = [updates[i].reshape(-1, rows, cols) for i in indices]  # [matrices, rows, cols] each
            orthogonal = orthogonalize_stacks(stacks, spec.steps, spec.dtype)
            for i, piece in zip(indices, orthogonal.split([len(s) for s in stacks])):
                results[i] = piece.reshape(updates[i].shape).to(updates[i].dtype)
    return results
