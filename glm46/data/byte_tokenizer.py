"""A byte-level tokenizer: UTF-8 bytes are ids 0-255, 256 ends a document. Needs no training."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    eos_token_id = 256
    vocab_size = 257

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")
