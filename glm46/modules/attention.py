"""Grouped-query attention with optional q/k/v bias, per-head QK RMSNorm before partial RoPE, and SDPA.

Rows of packed documents (position ids restarting at 0) run SDPA once per document with is_causal=True,
not once with a dense [B, 1, T, T] document mask: that mask is O(T^2) (1 GiB of bool per 32K row, and SDPA
adds a float copy of it), while the loop is exact, keeps SDPA on its flash kernels (CPU and CUDA) and costs
O(T). Measured on CPU, forward + backward of a 1-layer model (hidden 64, 2 heads) on a 32K row of 8
documents: peak memory +5.3 GiB in 35 s with the mask, +0.3 GiB in 1-3 s with the loop. FlexAttention was
the preferred candidate but has no backward on CPU in torch 2.13 (and uncompiled it materialises the
scores: +1.7 GiB for one 8K forward); torch.nn.attention.varlen is CUDA-only. So the loop is the one path
that trains, and is tested, here. Its costs: one kernel per document, and the lengths on the host (one
sync per forward, in Documents.from_positions, not per layer). On CUDA, in bf16 or fp16, the rows run instead
as one variable-length flash-attention call over all their documents (torch.nn.attention.varlen), once a GPU run
has verified it (glm46.modules.cuda_kernels).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import cuda_kernels
from .config import GLM46Config
from .generation import KVCache
from .layers import RMSNorm, apply_rotary_pos_emb


@dataclass  # not frozen: torch 2.11's Dynamo takes a frozen dataclass's fields as constants, guarding on each row's
class Documents:  # document count, so that each batch of other documents recompiled the layers (tests/test_compile.py)
    """The documents of rows of packed documents, found once per forward and shared by every layer."""

    ids: torch.Tensor  # [B, T] each token's document, counted from 0 in each row (on the model's device)
    lengths: list[list[int]]  # per row, its documents' lengths in order (summing to T), on the host
    cu_seqlens: torch.Tensor  # [documents + 1] int32 offsets of every row's documents in the [B * T] tokens
    max_length: int  # the longest document

    @classmethod
    def from_positions(cls, position_ids: torch.Tensor) -> Documents | None:
        """position_ids [B, T] -> the documents that start where a position id is 0 (and at each row's first
        token); None when every row is one document, which plain causal attention serves."""
        starts = position_ids == 0
        starts[:, 0] = True
        host = starts.cpu()  # the one host sync: SDPA's per-document slices need their lengths
        if not bool(host[:, 1:].any()):
            return None
        T = position_ids.shape[1]
        lengths = [torch.diff(row.nonzero().flatten(), append=torch.tensor([T])).tolist() for row in host]
        flat = torch.tensor([0] + [n for row in lengths for n in row]).cumsum(0, dtype=torch.int32)
        cu_seqlens = flat.to(position_ids.device, non_blocking=True)
        return cls(starts.cumsum(dim=-1) - 1, lengths, cu_seqlens, max(max(row) for row in lengths))


@torch.compiler.disable
def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents, scale: float
) -> torch.Tensor:
    """Causal attention within each document: q [B, heads, T, d], k, v [B, kv_heads, T, d] -> [B, heads, T, d].
    Left out of torch.compile's graphs (a compiled layer runs it between its graphs): each batch packs other documents,
    and a graph would specialise on their lengths, recompiling for every batch; the kernels it calls are fused
    already."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and cuda_kernels.enabled("varlen_attention"):
        return varlen_attention(q, k, v, documents, scale)
    return per_document_attention(q, k, v, documents.lengths, scale)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents, scale: float
) -> torch.Tensor:
    """packed_attention as one flash-attention call over the documents of all rows (CUDA, bf16 or fp16)."""
    from torch.nn.attention.varlen import varlen_attn

    B, H, T, d = q.shape
    kv_heads = k.shape[1]
    q, k, v = (t.transpose(1, 2).reshape(B * T, t.shape[1], d) for t in (q, k, v))  # [B * T, heads, d]
    options = _parameters(varlen_attn)
    # torch 2.10 takes is_causal; 2.11 on, a window (-1, 0) is causal
    kwargs = {"window_size": (-1, 0)} if "window_size" in options else {"is_causal": True}
    if "enable_gqa" in options:
        kwargs["enable_gqa"] = True
    elif kv_heads != H:
        k, v = (t.repeat_interleave(H // kv_heads, dim=1) for t in (k, v))
    if "scale" in options:
        kwargs["scale"] = scale
    elif scale != d**-0.5:
        raise NotImplementedError(f"this torch's varlen_attn has no scale argument (softmax scale {scale})")
    cu, longest = documents.cu_seqlens, documents.max_length
    out = varlen_attn(q, k, v, cu, cu, longest, longest, **kwargs)  # [B * T, H, d]
    return out.view(B, T, H, d).transpose(1, 2)


@functools.cache
def _parameters(fn) -> frozenset[str]:
    """The keyword names `fn` takes (looked up once, not per layer and step)."""
    return frozenset(inspect.signature(fn).parameters)


def per_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[list[int]], scale: float
) -> torch.Tensor:
    """packed_attention as one SDPA call per document; lengths: per row, its documents' lengths."""
    rows = []
    for b, row in enumerate(lengths):
        pieces = zip(*(t[b : b + 1].split(row, dim=2) for t in (q, k, v)))
        outs = [
            F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
            for qd, kd, vd in pieces
        ]
        rows.append(torch.cat(outs, dim=2))
    return torch.cat(rows, dim=0)


def padded_causal_mask(valid: torch.Tensor, past: int) -> torch.Tensor:
    """valid [B, past + T]: which keys are real tokens -> bool attn_mask [B, 1, T, past + T]. Query i sees the real
    keys up to past + i, and always itself: a left-pad query has no real key before it, and an all-masked row
    gives NaN in some SDPA kernels (real tokens never see a pad's output)."""
    keys = torch.arange(valid.shape[1], device=valid.device)  # [past + T]
    queries = keys[past:, None]  # [T, 1]
    return ((keys <= queries) & valid[:, None, None, :]) | (keys == queries)


class CausalAttention(nn.Module):
    """Attention of training and scoring (no cache): causal over each row, or within each document of packed rows.
    A module without weights of its own, so that context parallelism puts its kernel in this one's place
    (glm46.parallel.context_parallel.ContextParallelAttention)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None, scale: float
    ) -> torch.Tensor:
        """q [B, heads, T, d], k, v [B, kv_heads, T, d] -> [B, heads, T, d]."""
        if documents is not None:
            return packed_attention(q, k, v, documents, scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, config: GLM46Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.use_qk_norm = config.use_qk_norm
        if self.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.inner_attention = CausalAttention()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; with a cache, x holds the tokens after the cached ones (and pad keys
        that the cache marks are skipped).
        documents (rows of packed documents, no cache): each token sees the earlier tokens of its document."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:  # over the full head_dim, before RoPE and before the GQA repeat
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, head_dim]
        q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)

        scale = self.head_dim**-0.5
        if cache is None:
            out = self.inner_attention(q, k, v, documents, scale)
        else:
            past, mask = cache.length, None
            k, v = cache.update(self.layer_idx, k, v)
            if cache.valid is not None:  # left-padded prompts: no query sees a pad key
                mask = padded_causal_mask(cache.valid[:, : past + T], past)
            if mask is None and past > 0 and T > 1:  # a chunk after cached tokens: query i sees keys up to past + i
                mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            causal = mask is None and past == 0 and T > 1
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))
