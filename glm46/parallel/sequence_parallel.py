"""Sequence parallelism with tensor parallelism (Megatron-LM's, as torchtitan applies it): between the TP regions
the residual stream is split over the sequence, each TP rank holding T / tp consecutive tokens of every row.

Where the model runs on its tokens alone (norms, router, MTP's projection, lm_head and the loss) each TP rank
computes a part of what one TP rank computed for all tokens before, and activations there take 1/tp of the memory.
The TP regions see the whole sequence, as torchtitan lays them out with torch's TP API: their input is all-gathered
over the sequence (PrepareModuleInput from Shard to Replicate, kept a DTensor, so that the column-parallel weights'
partial input gradients are reduce-scattered once in backward) and the row-parallel outputs are reduce-scattered
(RowwiseParallel with output_layouts=Shard) instead of all-reduced: the same bytes as one all-reduce, split in two.
Routed experts folded over TP take the rank's own tokens (no split, no gather).

What the model needs is `SequenceShards` (glm46.modules duck-types it: `scatter`, `local`, `sum`, `size`):
set as `sequence` on the model and its MoE layers by glm46.parallel.parallelize. The loss of a rank is then its part
of the step's loss (its tokens' CE over all labelled tokens, its part of the balance loss), and the parameters that
see only the rank's tokens get their gradients summed over TP after the backward (`sequence_local`,
`all_reduce_sequence_local_grads`; Megatron's all-reduce of the layernorm gradients under sequence parallelism).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def block_sizes(length: int, parts: int) -> list[int]:
    """How `length` rows split into `parts` consecutive blocks, as torch.tensor_split splits them."""
    return [length // parts + (r < length % parts) for r in range(parts)]


def _own(x: torch.Tensor, sizes: list[int], dim: int, group) -> torch.Tensor:
    """This rank's block of `dim` (blocks of `sizes`, in rank order)."""
    rank = dist.get_rank(group)
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()


def _all_gather(x: torch.Tensor, sizes: list[int], dim: int, group) -> torch.Tensor:
    """Every rank's block of `dim`, concatenated in rank order (padded to the largest block on the wire: gloo
    gathers equal sizes only)."""
    if x.shape[dim] < max(sizes):
        pad = list(x.shape)
        pad[dim] = max(sizes) - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    parts = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat([part.narrow(dim, 0, n) for part, n in zip(parts, sizes)], dim=dim)


class _Split(torch.autograd.Function):
    """The same x on every rank of `group` -> this rank's block of `dim`; backward gathers the blocks' gradients
    (the same on every rank again). Megatron's scatter to the sequence-parallel region."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], dim: int, group) -> torch.Tensor:
        ctx.sizes, ctx.dim, ctx.group = sizes, dim, group
        return _own(x, sizes, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.sizes, ctx.dim, ctx.group), None, None, None


class _Gather(torch.autograd.Function):
    """Each rank's block of `dim` -> all of them, for what every rank then computes whole: backward keeps this
    rank's block of the (same) gradient. Megatron's gather from the sequence-parallel region, without reduction."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], dim: int, group) -> torch.Tensor:
        ctx.sizes, ctx.dim, ctx.group = sizes, dim, group
        return _all_gather(x, sizes, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _own(grad, ctx.sizes, ctx.dim, ctx.group), None, None, None


def split_blocks(x: torch.Tensor, sizes: list[int], dim: int, group) -> torch.Tensor:
    return _Split.apply(x, sizes, dim, group)


def gather_blocks(x: torch.Tensor, sizes: list[int], dim: int, group) -> torch.Tensor:
    return _Gather.apply(x, sizes, dim, group)


class SequenceShards:
    """The TP group's split of the sequence (dim 1 of [B, T, ...]): T / size consecutive tokens per rank."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)

    def _sizes(self, x: torch.Tensor) -> list[int]:
        return block_sizes(x.shape[1], self.size)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor every rank computed whole (the embeddings) -> this rank's tokens; its gradient is whole again."""
        return split_blocks(x, self._sizes(x), 1, self.group)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens -> every rank's, for a computation every rank runs whole (the logits)."""
        return gather_blocks(x, [x.shape[1]] * self.size, 1, self.group)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a tensor without gradient (labels)."""
        return _own(x, self._sizes(x), 1, self.group)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks' tokens of a count (no gradient)."""
        x = x.detach().clone()
        dist.all_reduce(x, group=self.group)
        return x


# Parameters TP leaves whole that, under sequence parallelism, see only the rank's tokens: the norms (not the
# per-head QK norms, which see every token of their heads), the router, MTP's projection and the lm_head.
_SEQUENCE_LOCAL = re.compile(r"(layernorm|\.norm|enorm|hnorm)\.weight$|mlp\.gate\.weight$|eh_proj\.|^lm_head\.")


def sequence_local(name: str, experts_folded: bool) -> bool:
    """Whether parameter `name` gets only this rank's tokens' gradient: the rules above, and the routed experts when
    they are not split over an ep group spanning TP (each TP rank runs its tokens on its whole copy)."""
    if ".experts." in name:
        return not experts_folded
    return bool(_SEQUENCE_LOCAL.search(name))


@torch.no_grad()
def all_reduce_sequence_local_grads(model: torch.nn.Module, group, experts_folded: bool) -> None:
    """Sum over the TP group the gradients of the parameters that saw only their rank's tokens, once per step."""
    for name, p in model.named_parameters():
        if p.grad is not None and sequence_local(name, experts_folded):
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(grad, group=group)
