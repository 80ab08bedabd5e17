"""Quintic Newton-Schulz orthogonalisation (Keller Jordan's Muon), batched over leading dimensions."""

import torch

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7


def orthogonalize(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximately U V^T of each matrix in g [..., rows, cols], in `dtype`, as torch.optim.Muon computes it.

    A stack [E, rows, cols] (the routed experts) is orthogonalised per matrix in one batched call.
    """
    a, b, c = COEFFICIENTS
    x = g.to(dtype).reshape(-1, *g.shape[-2:])  # [batch, rows, cols]
    tall = g.shape[-2] > g.shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=EPS)
    for _ in range(steps):
        gram = x @ x.mT
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b * A + c * A @ A
        x = torch.baddbmm(x, update, x, beta=a)  # a * X + (b * A + c * A @ A) @ X
    if tall:
        x = x.mT
    return x.reshape(g.shape)
