"""The DataModule interface the trainer consumes: fixed-length windows over a token stream.

Every batch is {input_ids, labels, position_ids, loss_mask}, each [B, T]; labels[:, i] is the token
after input_ids[:, i]. Documents are concatenated with an end-of-document token and cut into
windows (GLM pre-training packs without best-fit: random truncation is fine there).
"""

from __future__ import annotations

import lightning as L
import numpy as np
from torch.utils.data import DataLoader, Dataset

from glm46.data.byte_tokenizer import ByteTokenizer
from glm46.data.documents import Ledger
from glm46.data.embedded import stdlib_code


def window(tokens: np.ndarray, start: int, seq_len: int) -> dict[str, np.ndarray]:
    """The training sample of seq_len tokens at `start` (and the next token for the last label), as arrays
    (DataLoader's collation makes them tensors)."""
    chunk = np.asarray(tokens[start : start + seq_len + 1], dtype=np.int64)
    return {"input_ids": chunk[:-1], "labels": chunk[1:], "position_ids": np.arange(seq_len),
            "loss_mask": np.ones(seq_len, dtype=np.int64)}


class TokenWindows(Dataset):
    """Non-overlapping windows of seq_len + 1 tokens over a flat token array."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens cannot fill one window of seq_len={seq_len}")
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return window(self.tokens, index * self.seq_len, self.seq_len)


class StdlibDataModule(L.LightningDataModule):
    """The Python standard library as a byte-level token stream: a corpus every machine has.

    The last `val_fraction` of the stream is held out for validation.
    """

    def __init__(self, seq_len: int = 256, batch_size: int = 8, max_bytes: int = 8_000_000,
                 val_fraction: float = 0.02, num_workers: int = 0):
        super().__init__()
        self.save_hyperparameters()
        self.tokenizer = ByteTokenizer()
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        eos = np.array([self.tokenizer.eos_token_id], dtype=np.uint16)
        parts, total = [], 0
        for doc in stdlib_code(Ledger()):
            if doc.domain != "code" or total + len(doc.text) > self.hparams.max_bytes:
                break  # modules come first, then packages
            total += len(doc.text)
            parts += [self.tokenizer.encode(doc.text), eos]
        tokens = np.concatenate(parts)
        split = int(len(tokens) * (1 - self.hparams.val_fraction))
        self.train_set = TokenWindows(tokens[:split], self.hparams.seq_len)
        self.val_set = TokenWindows(tokens[split:], self.hparams.seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)
