"""Cross-entropy through the lm_head in chunks, so [tokens, vocab] logits never exist for the whole batch.

Each chunk's logits are recomputed in the backward pass (activation checkpointing), so memory
holds one chunk of logits at a time: 4096 tokens x 151552 vocab x 4 bytes = 2.5 GB instead of
the whole batch's.
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 4096
) -> torch.Tensor:
    """Mean CE of `hidden @ weight.T` against labels over non-ignored tokens.

    hidden [..., H], weight [V, H], labels [...] with IGNORE_INDEX for tokens without a target.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    count = (labels != IGNORE_INDEX).sum().clamp(min=1)
    if hidden.shape[0] <= chunk_size:  # one chunk: recomputing its logits would save nothing
        return _chunk_loss_sum(hidden, weight, labels) / count
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(hidden.split(chunk_size), labels.split(chunk_size)):
        total = total + checkpoint(_chunk_loss_sum, h, weight, y, use_reentrant=False)
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
