"""SFT batches: chat conversations from prepared shards (the embedded `sft` domain, or any domain of
documents rendered with glm46.data.chat.render_chat), packed best-fit (or one per row, padded), with the
loss on assistant tokens only: labels are IGNORE_INDEX everywhere else. A document that is no conversation (it does
not open with [gMASK]: pre-training text in the mixture, or replayed from another dataset with `replay`) is trained
on every token, as pre-training trains it, so that SFT can keep what pre-training taught.

Everything else is ShardDataModule's: the mixture over chat domains, sampling from (seed, sample
index) split across ranks, the held-out documents for validation, the O(1) resumable data position
and the fingerprint check.
"""

from __future__ import annotations

import numpy as np

from glm46.data.chat import ChatTokens, assistant_mask
from glm46.data.tokenizer import GLMTokenizer
from glm46.errors import ConfigError
from glm46.lit.shard_data import ShardDataModule


class ConversationTargets:
    """A packed row's assistant tokens (`assistant_mask`): computed over the whole row, which is exact for
    pieces that start a conversation (each begins with [gMASK]), and from the conversation's start for a
    piece that continues one cut at a bin's length, so that it keeps its roles."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, chat: ChatTokens):
        self.tokens, self.offsets, self.chat = tokens, offsets, chat

    def __call__(self, ids: np.ndarray, pieces: list[tuple[int, int]]) -> np.ndarray:
        mask = assistant_mask(ids, self.chat)
        starts = np.array([start for start, _ in pieces])
        firsts = self.offsets[np.searchsorted(self.offsets, starts, side="right") - 1]
        used = 0
        for (start, length), first in zip(pieces, firsts):
            if self.tokens[first] != self.chat.gmask:  # plain text (replayed pre-training data): every token
                mask[used : used + length] = 1
            elif first != start:
                mask[used : used + length] = self.span(start, length)
            used += length
        return mask

    def span(self, start: int, count: int) -> np.ndarray:
        """The mask of tokens[start : start + count], read from the start of its conversation."""
        first = int(self.offsets[np.searchsorted(self.offsets, start, side="right") - 1])
        return assistant_mask(self.tokens[first : start + count], self.chat)[start - first :]


def check_packing(packing: str) -> None:
    """SFT's rule on its `packing`, run by the constructor and, at composition, by glm46.config.checks."""
    if packing == "truncate":
        raise ConfigError(
            "data.packing='truncate' with SFT data (data=sft, embedded_sft) would cut conversations at random: "
            "SFT takes packing best_fit (whole conversations) or pad (one per row)"
        )


class SFTDataModule(ShardDataModule):
    def __init__(
        self,
        path: str,
        seq_len: int,
        batch_size: int,
        mixture: dict[str, float],
        seed: int = 0,
        val_fraction: float = 0.02,
        val_windows: int = 16,
        phase: str = "sft",
        packing: str = "best_fit",
        num_workers: int = 0,
        replay: dict | None = None,
    ):
        """replay: pre-training data trained beside the conversations (ShardDataModule's `replay`)."""
        check_packing(packing)
        super().__init__(
            path, seq_len, batch_size, mixture, seed, val_fraction, val_windows, phase, packing, num_workers, replay
        )
        self.chat = ChatTokens(GLMTokenizer.from_file(self.root / "tokenizer.json"))

    def targets(self, tokens: np.ndarray, offsets: np.ndarray) -> ConversationTargets:
        return ConversationTargets(tokens, offsets, self.chat)
