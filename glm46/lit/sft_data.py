"""SFT batches: chat conversations from prepared shards (the embedded `sft` domain, or any domain of
documents rendered with glm46.data.chat.render_chat), packed best-fit (or one per row, padded), with the
loss on assistant tokens only: labels are IGNORE_INDEX everywhere else.

Everything else is ShardDataModule's: the mixture over chat domains, sampling from (seed, sample
index) split across ranks, the held-out documents for validation, the O(1) resumable data position
and the fingerprint check.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from glm46.data.chat import ChatTokens, assistant_mask
from glm46.data.tokenizer import GLMTokenizer
from glm46.lit.shard_data import ShardDataModule


class ConversationTargets:
    """tokens[start : start + count] -> 1 on assistant tokens (`assistant_mask`), read from the start of the
    conversation the span lies in, so a conversation cut into pieces keeps its roles."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, chat: ChatTokens):
        self.tokens, self.offsets, self.chat = tokens, offsets, chat

    def __call__(self, start: int, count: int) -> np.ndarray:
        first = int(self.offsets[np.searchsorted(self.offsets, start, side="right") - 1])
        return assistant_mask(self.tokens[first : start + count], self.chat)[start - first :]


class SFTDataModule(ShardDataModule):
    def __init__(self, path: str, seq_len: int, batch_size: int, mixture: dict[str, float], seed: int = 0,
                 val_fraction: float = 0.02, val_windows: int = 16, phase: str = "sft", packing: str = "best_fit"):
        if packing == "truncate":
            raise ValueError("data.packing=truncate would cut conversations at random: SFT packs whole "
                             "conversations (best_fit) or pads one per row (pad)")
        super().__init__(path, seq_len, batch_size, mixture, seed, val_fraction, val_windows, phase, packing)
        self.chat = ChatTokens(GLMTokenizer.from_file(self.root / "tokenizer.json"))

    def targets(self, tokens: np.ndarray, offsets: np.ndarray) -> Callable[[int, int], np.ndarray]:
        return ConversationTargets(tokens, offsets, self.chat)
