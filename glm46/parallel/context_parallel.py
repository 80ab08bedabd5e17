"""Context parallelism: each of `cp` ranks holds 1/cp of every sequence, and attention sees all of it.

The variant Llama 3 trains long context with (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2):
each rank computes Q, K and V for its own tokens, K and V are all-gathered over the cp group (GQA makes them a
fraction of the hidden state: GLM-4.6's 8 KV heads x 128 x 2 = 2,048 values per token against a hidden size of
5,120), and each rank's queries attend to the gathered keys. Everything else (norms, MoE, MTP, loss) runs on the
rank's own tokens, so activations take 1/cp of the memory.

Load balancing (torch's `context_parallel` and Megatron-LM's): the sequence is cut into 2 x cp chunks and rank r
keeps chunks r and 2 cp - 1 - r, so every rank has one early and one late chunk and the causal work is even.

torch's own `context_parallel` (ring attention) patches the CUDA SDPA kernels and takes causal rows of one document;
it does not run on the CPU's kernel, nor on rows of packed documents. So attention here is written on the per-block
kernels that return their log-sum-exp, as torch's ring attention is: `aten._scaled_dot_product_flash_attention_for_cpu`
on CPU; on CUDA (once a GPU run has verified it, glm46.modules.cuda_kernels) `_scaled_dot_product_flash_attention`
for bf16/fp16 and `_scaled_dot_product_efficient_attention` for fp32, with the kv heads repeated for the query
heads. Each query piece (the part of a local chunk inside one document) attends to its document's earlier keys
without a mask and to its own keys causally, the two blocks merged by their log-sum-exps; the backward runs each
block's kernel backward on the merged output and log-sum-exp, which gives exact gradients (the flash-attention
backward only needs the final output and normaliser of each query).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from glm46.modules import cuda_kernels

aten = torch.ops.aten


class ContextShards:
    """The cp group's load-balanced split of the sequence (dim 1 of [B, T, ...]): rank r holds chunks r and
    2 cp - 1 - r of 2 cp."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def query_ranges(self, length: int) -> list[tuple[int, int]]:
        """The two spans [start, end) of the whole sequence this rank holds, in the order it holds them."""
        if length % (2 * self.size):
            raise ValueError(
                f"a sequence of {length} tokens does not split into 2 x context_parallel = {2 * self.size} chunks"
            )
        chunk = length // (2 * self.size)
        return [(i * chunk, (i + 1) * chunk) for i in (self.rank, 2 * self.size - 1 - self.rank)]

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a tensor every rank holds whole (input ids, positions, labels): [B, T, ...] ->
        [B, T / cp, ...]."""
        return torch.cat([x[:, start:end] for start, end in self.query_ranges(x.shape[1])], dim=1)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's tokens in sequence order, for what every rank then computes whole (the logits): backward
        keeps this rank's part of the (same) gradient."""
        return _GatherSequence.apply(x, dim, self, False)

    def gather_keys(self, x: torch.Tensor) -> torch.Tensor:
        """K or V [B, heads, T / cp, d] -> [B, heads, T, d] in sequence order; backward sums every rank's gradient
        of this rank's keys (each rank's queries attended to them)."""
        return _GatherSequence.apply(x, 2, self, True)

    def attention(self, q, k, v, lengths: list[list[int]] | None, scale: float) -> torch.Tensor:
        """Attention of this rank's queries q [B, H, T / cp, d] with its keys and values k, v [B, KV, T / cp, d]
        (RoPE applied) over the whole rows: K and V all-gathered, each query seeing its document's earlier tokens.
        lengths: per row, its documents' lengths (glm46.modules.attention.Documents); None: one document per row."""
        k, v = self.gather_keys(k), self.gather_keys(v)
        ranges = self.query_ranges(k.shape[2])
        rows = lengths if lengths is not None else [[k.shape[2]]] * q.shape[0]
        return ContextAttention.apply(q, k, v, [attention_pieces(ranges, row) for row in rows], scale)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks' tokens of a count or loss term (no gradient)."""
        x = x.detach().clone()
        dist.all_reduce(x, group=self.group)
        return x


class ContextParallelAttention(nn.Module):
    """The attention kernel of a layer whose rows are split over the cp ranks: in the place of the model's own
    (glm46.modules.attention.CausalAttention), with the same arguments."""

    def __init__(self, shards: ContextShards):
        super().__init__()
        self.shards = shards

    def forward(self, q, k, v, documents, scale: float) -> torch.Tensor:
        return self.shards.attention(q, k, v, documents.lengths if documents is not None else None, scale)


class _GatherSequence(torch.autograd.Function):
    """All-gather of the ranks' chunks along `dim`, put back in sequence order (rank r's first half is chunk r, its
    second chunk 2 cp - 1 - r). Backward: this rank's chunks of the gradient, summed over the ranks first when
    `summed` (each rank used the gathered tensor for its own queries)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, shards: ContextShards, summed: bool) -> torch.Tensor:
        ctx.dim, ctx.shards, ctx.summed = dim, shards, summed
        parts = [torch.empty_like(x) for _ in range(shards.size)]
        dist.all_gather(parts, x.contiguous(), group=shards.group)
        halves = [part.chunk(2, dim=dim) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.summed:  # summed in fp32 (at least), as torch's ring attention sums its key gradients
            dtype = grad.dtype
            grad = grad.to(torch.promote_types(dtype, torch.float32)).contiguous()
            dist.all_reduce(grad, group=ctx.shards.group)
            grad = grad.to(dtype)
        chunks = grad.chunk(2 * ctx.shards.size, dim=ctx.dim)
        rank = ctx.shards.rank
        return torch.cat([chunks[rank], chunks[-1 - rank]], dim=ctx.dim), None, None, None


def attention_pieces(query_ranges: list[tuple[int, int]], lengths: list[int]) -> list[tuple[int, int, int, int]]:
    """The work of one row: its local queries (the spans `query_ranges` of the whole row, concatenated) cut at its
    documents' boundaries (`lengths`, in order, summing to the row's length). Each piece is (q_start, q_end,
    doc_start, key_start): local queries [q_start, q_end) are the whole row's [key_start, key_start + q_end -
    q_start), in the document that starts at doc_start: they see its keys [doc_start, key_start) unmasked and
    their own causally."""
    pieces, local = [], 0
    for start, end in query_ranges:
        doc_start = 0
        for length in lengths:
            doc_end = doc_start + length
            lo, hi = max(start, doc_start), min(end, doc_end)
            if lo < hi:
                pieces.append((local + lo - start, local + hi - start, doc_start, lo))
            doc_start = doc_end
        local += end - start
    return pieces


def _block(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Attention of one block and its per-query log-sum-exp: q [1, H, L, d], k, v [1, KV, S, d] -> out [1, H, L, d],
    lse [1, H, L] (fp32, or fp64 for fp64 inputs), and what the kernel's backward needs besides. Causal is
    top-left aligned (query i sees keys 0..i); causal blocks are square here, so the alignment never matters."""
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    if not (q.is_cuda and cuda_kernels.enabled("context_flash")):
        raise NotImplementedError(
            f"context parallelism's attention on {q.device.type} needs the CUDA kernels that bench/gpu_suite.py "
            f"verifies (glm46.modules.cuda_kernels 'context_flash'), not yet verified on a GPU"
        )
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    if q.dtype in (torch.bfloat16, torch.float16):  # flash: [B, H, L] lse, and its rng state (unused without dropout)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    # the memory-efficient kernel may pad its lse's query dim (to 32): merged here on the queries, padded back later
    return out, lse[..., : q.shape[2]], (seed, offset, lse.shape[-1])


def _block_backward(grad, q, k, v, out, lse, aux: tuple, causal: bool, scale: float):
    """The block kernel's backward on the merged output and log-sum-exp of its queries: -> dq, dk, dv."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    kv_heads = k.shape[1]
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    if q.dtype in (torch.bfloat16, torch.float16):
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
        )
    else:
        seed, offset, lse_length = aux
        lse = torch.nn.functional.pad(lse, (0, lse_length - lse.shape[-1])).contiguous()
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
        )
    return dq, _sum_kv(dk, kv_heads), _sum_kv(dv, kv_heads)


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[1, KV, S, d] -> [1, heads, S, d], each kv head repeated for its group of query heads (the CUDA kernels'
    GQA support differs between torch versions; the CPU kernel takes the KV heads as they are)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of _repeat_kv: [1, heads, S, d] -> [1, KV, S, d], summed over each kv head's group."""
    B, heads, S, d = grad.shape
    return grad if heads == kv_heads else grad.view(B, kv_heads, heads // kv_heads, S, d).sum(dim=2)


def _blocks(piece: tuple[int, int, int, int]) -> list[tuple[int, int, bool]]:
    """The key blocks of a piece: (start, end, causal) of the whole row's keys."""
    q_start, q_end, doc_start, key_start = piece
    blocks = [(key_start, key_start + q_end - q_start, True)]
    if doc_start < key_start:
        blocks.append((doc_start, key_start, False))
    return blocks


class ContextAttention(torch.autograd.Function):
    """Local queries against the whole row's keys, per document: q [B, H, T / cp, d], k, v [B, KV, T, d] ->
    [B, H, T / cp, d]. `pieces`: per row, attention_pieces of it."""

    @staticmethod
    def forward(ctx, q, k, v, pieces: list[list[tuple[int, int, int, int]]], scale: float) -> torch.Tensor:
        out, aux = torch.zeros_like(q), []  # aux: each piece's blocks' kernel state, in order
        accumulate = torch.promote_types(q.dtype, torch.float32)  # the kernel's log-sum-exp dtype
        lse = torch.full(q.shape[:3], float("-inf"), dtype=accumulate, device=q.device)
        for b, row in enumerate(pieces):
            for piece in row:
                rows = (slice(b, b + 1), slice(None), slice(piece[0], piece[1]))
                query = q[rows].contiguous()
                outs, lses, kernel_state = zip(
                    *(
                        _block(query, k[b : b + 1, :, s:e], v[b : b + 1, :, s:e], causal, scale)
                        for s, e, causal in _blocks(piece)
                    )
                )
                aux.append(kernel_state)
                total = torch.stack(lses).logsumexp(dim=0)  # the piece's log-sum-exp over all its keys
                merged = sum(o.to(accumulate) * (part - total).exp()[..., None] for o, part in zip(outs, lses))
                out[rows], lse[rows] = merged.to(q.dtype), total
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pieces, ctx.scale, ctx.aux = pieces, scale, aux
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        accumulate = torch.promote_types(q.dtype, torch.float32)  # the blocks' gradients summed in fp32 (at least)
        dq, dk, dv = (torch.zeros_like(t, dtype=accumulate) for t in (q, k, v))
        kernel_states = iter(ctx.aux)
        for b, row in enumerate(ctx.pieces):
            for piece in row:
                states = next(kernel_states)
                rows = (slice(b, b + 1), slice(None), slice(piece[0], piece[1]))
                # every block's backward on the piece's merged output and log-sum-exp
                local = [t[rows].contiguous() for t in (grad, q, out, lse)]
                for (s, e, causal), state in zip(_blocks(piece), states):
                    keys = (slice(b, b + 1), slice(None), slice(s, e))
                    gq, gk, gv = _block_backward(
                        local[0],
                        local[1],
                        k[keys].contiguous(),
                        v[keys].contiguous(),
                        *local[2:],
                        state,
                        causal,
                        ctx.scale,
                    )
                    dq[rows] += gq
                    dk[keys] += gk
                    dv[keys] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
