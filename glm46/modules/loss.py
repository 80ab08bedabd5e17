"""Cross-entropy through the lm_head, fused by hand and in chunks, so [tokens, vocab] buffers stay few.

`LinearCrossEntropy` computes the loss from the logits' logsumexp and the gradient of the logits, softmax -
onehot, in the logits' own buffer: the log_softmax output, its gradient and the zero-filled gradient of nll_loss
never exist. On the CPU those were fresh 33 MB buffers per 1024 tokens of an 8K vocabulary, and the default
run's model spent 15% of its step in log_softmax and its backward.

When the batch's logits would pass LOGITS_CHUNK_BYTES (4096 tokens x 151552 vocab x 4 bytes = 2.5 GB), the
tokens go in chunks that keep no logits: each chunk's are recomputed in the backward pass (as activation
checkpointing would), so memory holds one chunk of logits at a time.
"""

import torch
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100
LOGITS_CHUNK_BYTES = 4096 * 151552 * 4  # fp32 logits of one chunk: 4096 tokens of GLM-4.6's vocabulary, 2.5 GB


def chunk_tokens(vocab_size: int) -> int:
    """Tokens per cross-entropy chunk: as many as keep its fp32 logits within LOGITS_CHUNK_BYTES. A small vocabulary
    takes the whole batch in one chunk, so no logits are recomputed (the default run's 8K: 75K tokens)."""
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab_size))


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits [N, V] of hidden [N, H] and weight [V, H], already in the matmul dtype."""
    with torch.autocast(hidden.device.type, enabled=False):
        return (hidden @ weight.T).float()


class LinearCrossEntropy(torch.autograd.Function):
    """Sum over labelled tokens of cross_entropy(hidden @ weight.T, labels), the matmuls in the autocast dtype
    (else hidden's) and the softmax in fp32, as F.linear + F.cross_entropy under autocast compute it.

    The logits buffer is the only [N, V] one: the forward turns it into exp(logits - row max) in place (its row
    sums give the logsumexp), and the backward into the gradient, softmax - onehot, in place again."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, keep_logits: bool):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        h, w = hidden.to(dtype), weight.to(dtype)
        logits = _logits(h, w)  # [N, V]
        target = logits.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)  # [N]
        peak = logits.amax(dim=-1)  # [N]
        exp = logits.sub_(peak[:, None]).exp_()  # in place: exp(logits - peak)
        sums = exp.sum(dim=-1)
        lse = sums.log() + peak
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.save_for_backward(h, w, labels, lse, *((exp, sums) if keep_logits else ()))
        return torch.where(labels != IGNORE_INDEX, lse - target, 0.0).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        h, w, labels, lse, *kept = ctx.saved_tensors
        scale = (labels != IGNORE_INDEX).to(lse.dtype) * grad  # unlabelled rows get no gradient
        if kept:  # softmax = exp / sums, written over exp (a second backward is refused)
            exp, sums = kept
            g = exp.mul_((scale / sums)[:, None])
        else:
            g = _logits(h, w).sub_(lse[:, None]).exp_().mul_(scale[:, None])
        # d loss / d logits [N, V]: (softmax - onehot) * scale; an unlabelled row's scale is 0 (no rows are picked
        # out by a mask: that would read their count on the host)
        g.scatter_add_(1, labels.clamp(min=0)[:, None], -scale[:, None])
        g = g.to(h.dtype)
        with torch.autocast(h.device.type, enabled=False):
            grad_hidden, grad_weight = g @ w, g.T @ h
        return grad_hidden.to(ctx.dtypes[0]), grad_weight.to(ctx.dtypes[1]), None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 4096,
    count: torch.Tensor | None = None,
    keep_logits: bool = True,
) -> torch.Tensor:
    """Mean CE of `hidden @ weight.T` against labels over non-ignored tokens.

    hidden [..., H], weight [V, H], labels [...] with IGNORE_INDEX for tokens without a target. count: what the
    summed CE is divided by, when these tokens are a part (a pipeline microbatch) of the batch that is averaged over.
    keep_logits=False recomputes the logits in the backward even for one chunk: needed where the backward runs
    twice (pipeline schedules that take the weights' gradients in a second pass), as the first overwrites them.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if count is None:
        count = (labels != IGNORE_INDEX).sum().clamp(min=1)
    keep_logits = keep_logits and hidden.shape[0] <= chunk_size  # one chunk: recomputing would save nothing
    total = sum(
        LinearCrossEntropy.apply(h, weight, y, keep_logits)
        for h, y in zip(hidden.split(chunk_size), labels.split(chunk_size))
    )
    return total / count


def shift_labels(labels: torch.Tensor, k: int, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Targets for MTP depth k at position i: labels[i + k] (token i+k+1); the last k positions have none, nor,
    given the document of each token of packed rows (document_ids [B, T], non-decreasing), the positions whose
    token i+k+1 is in a later document: MTP, like the main loss, never predicts across a document boundary.
    labels [B, T]."""
    T = labels.shape[1]
    shifted = labels.roll(-k, dims=1)
    shifted[:, T - k :] = IGNORE_INDEX
    if document_ids is not None:
        # Token i+k+1's document; for i+k+1 = T (past the row) token i+k's, and labels[T-1] says the rest.
        target = torch.arange(k + 1, T + k + 1, device=labels.device).clamp(max=T - 1)
        later = document_ids.gather(1, target.expand_as(document_ids)) != document_ids
        shifted = shifted.masked_fill(later, IGNORE_INDEX)
    return shifted
