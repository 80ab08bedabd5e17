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
from glm46.data.windows import MixtureWindows, window
from glm46.lit.shard_data import samples_consumed
from glm46.parallel.data_parallel import data_parallel_rank_and_size


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

    The last `val_fraction` of the stream is held out for validation. Training windows start at random
    offsets drawn from (seed, sample index), as glm46.data.windows draws them, so the data position saved
    in a checkpoint (samples consumed) makes a resume read exactly what the interrupted run would have.
    """

    def __init__(
        self,
        seq_len: int = 256,
        batch_size: int = 8,
        max_bytes: int = 8_000_000,
        val_fraction: float = 0.02,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.tokenizer = ByteTokenizer()
        self.train_tokens: np.ndarray | None = None
        self.val_set: TokenWindows | None = None
        self.start_sample = 0

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def setup(self, stage: str | None = None) -> None:
        if self.train_tokens is not None:
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
        if split <= self.hparams.seq_len:
            raise ValueError(
                f"data.max_bytes={self.hparams.max_bytes} gives {split} training tokens, fewer than "
                f"one window of data.seq_len={self.hparams.seq_len}"
            )
        self.train_tokens = tokens[:split]
        self.val_set = TokenWindows(tokens[split:], self.hparams.seq_len)

    def train_dataloader(self) -> DataLoader:
        rank, world = data_parallel_rank_and_size(self.trainer) if self.trainer else (0, 1)
        dataset = MixtureWindows(
            {"code": self.train_tokens},
            {"code": 1.0},
            self.hparams.seq_len,
            self.hparams.seed,
            self.start_sample,
            rank,
            world,
            batch_size=self.hparams.batch_size,
        )
        return DataLoader(dataset, batch_size=None, num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)

    def state_dict(self) -> dict:
        """The data position: global samples this run has trained on (tokens seen / seq_len)."""
        return {"seed": self.hparams.seed, "samples": samples_consumed(self.trainer, self.hparams.seq_len)}

    def load_state_dict(self, state: dict) -> None:
        self.start_sample = state["samples"]
