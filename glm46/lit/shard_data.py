"""Training batches from prepared token shards: a domain mixture, random-truncation windows (pre-training)
or packed documents (mid-training, SFT), and sampling that is a pure function of (seed, sample index).

Global sample g goes to data-parallel rank g % world_size, so ranks never overlap; the position in
the stream is the number of samples the run has consumed (tokens seen / seq_len), so the
DataModule's checkpoint state is O(1): phase, seed, fingerprint, samples. A resume on shards with
another fingerprint fails instead of silently training on different data.

Every domain's last `val_fraction` of documents is held out: validation reads only those, training
never does. Subclasses (glm46.lit.sft_data, glm46.lit.rl_data) change what a sample is through the
hooks `targets`, `document_bins` and `dataset`.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from glm46.data.shards import load_shard, read_index
from glm46.modules.loss import IGNORE_INDEX
from glm46.parallel.strategies import data_parallel_rank_and_size

PACKINGS = ("truncate", "best_fit", "pad")


def samples_consumed(trainer, seq_len: int) -> int:
    """Global samples a run has trained on (tokens seen / seq_len): the data position saved in checkpoints."""
    return (trainer.lightning_module.tokens_seen if trainer else 0) // seq_len


class DataMismatchError(RuntimeError):
    """A checkpoint's data state does not fit the configured dataset."""


class DomainStream:
    """One domain's tokens, split by documents into a training part and a held-out tail."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, val_fraction: float):
        held_out = int(round((len(offsets) - 1) * val_fraction))
        split = int(offsets[len(offsets) - 1 - held_out])
        self.train, self.val = tokens[:split], tokens[split:]
        self.train_offsets = offsets[: len(offsets) - held_out]
        self.val_offsets = offsets[len(offsets) - 1 - held_out :] - split


def document_pieces(offsets: np.ndarray, capacity: int) -> list[tuple[int, int]]:
    """Documents as (start, length), a document longer than `capacity` cut into capacity-sized pieces."""
    pieces = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        pieces += [(int(s), int(min(capacity, end - s))) for s in range(int(start), int(end), capacity)]
    return pieces


def best_fit_bins(offsets: np.ndarray, capacity: int) -> list[list[tuple[int, int]]]:
    """Best-fit decreasing: documents (start, length), longest first, each into the bin it fills most
    tightly; a document longer than a bin is cut into bin-sized pieces. No document is truncated away."""
    pieces = sorted(document_pieces(offsets, capacity), key=lambda piece: (-piece[1], piece[0]))
    bins: list[list[tuple[int, int]]] = []
    free: list[tuple[int, int]] = []  # sorted (space left, bin number)
    for piece in pieces:
        slot = bisect.bisect_left(free, (piece[1], -1))
        if slot == len(free):
            bins.append([piece])
            bisect.insort(free, (capacity - piece[1], len(bins) - 1))
        else:
            space, number = free.pop(slot)
            bins[number].append(piece)
            bisect.insort(free, (space - piece[1], number))
    return bins


def packed(
    tokens: np.ndarray,
    pieces: list[tuple[int, int]],
    seq_len: int,
    pad_id: int,
    targets: Callable[[np.ndarray, list[tuple[int, int]]], np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Documents end to end with restarting position ids; no loss across a boundary or on padding, and
    with `targets` (the row's ids and pieces -> 1 where a token is a training target), only on the tokens
    it marks. Labels are IGNORE_INDEX wherever loss_mask is 0."""
    ids = np.full(seq_len + 1, pad_id, dtype=np.int64)
    positions = np.empty(seq_len + 1, dtype=np.int64)
    inside = np.zeros(seq_len + 1, dtype=np.int64)  # 1 where the next token is in the same piece
    used = 0
    for start, length in pieces:
        ids[used : used + length] = tokens[start : start + length]
        positions[used : used + length] = np.arange(length)
        inside[used : used + length - 1] = 1
        used += length
    positions[used:] = np.arange(seq_len + 1 - used)
    mask = inside[:-1] if targets is None else inside[:-1] * targets(ids, pieces)[1:]
    return {
        "input_ids": ids[:-1],
        "labels": np.where(mask == 1, ids[1:], IGNORE_INDEX),
        "position_ids": positions[:-1],
        "loss_mask": mask,
    }


def window(tokens: np.ndarray, start: int, seq_len: int) -> dict[str, np.ndarray]:
    """The training sample of seq_len tokens at `start` (and the next token for the last label), as arrays
    (DataLoader's collation makes them tensors)."""
    chunk = np.asarray(tokens[start : start + seq_len + 1], dtype=np.int64)
    return {
        "input_ids": chunk[:-1],
        "labels": chunk[1:],
        "position_ids": np.arange(seq_len),
        "loss_mask": np.ones(seq_len, dtype=np.int64),
    }


def uniforms(seed: int, indices: np.ndarray, draws: int = 2) -> np.ndarray:
    """[len(indices), draws] floats in [0, 1), a pure function of (seed, index, draw): SplitMix64 over a
    counter, vectorised, so a batch of samples costs a few array operations instead of a generator each."""
    with np.errstate(over="ignore"):
        counter = (
            np.asarray(indices, dtype=np.uint64)[:, None] * np.uint64(draws)
            + np.arange(draws, dtype=np.uint64)[None, :]
            + np.uint64(seed) * np.uint64(0xD1B54A32D192ED03)
        )
        z = counter * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


class MixtureWindows(IterableDataset):
    """Infinite batches: global sample g picks a domain by the mixture weights, then a window at a random
    offset (`bins` None: random truncation) or one of the domain's bins (packed documents), from (seed, g).

    This rank's k-th sample is g = start + k * world_size + rank, and batch b holds its samples
    b * batch_size ... (b + 1) * batch_size - 1, so the stream is the same for any number of DataLoader
    workers (worker w builds batches w, w + workers, ...; the DataLoader returns them in order)."""

    def __init__(
        self,
        streams: dict[str, np.ndarray],
        weights: dict[str, float],
        seq_len: int,
        seed: int,
        start: int,
        rank: int,
        world_size: int,
        bins: dict[str, list] | None = None,
        pad_id: int = 0,
        targets: dict[str, Callable | None] | None = None,
        batch_size: int = 1,
    ):
        self.domains = [d for d in weights if weights[d] > 0]
        self.streams = [streams[d] for d in self.domains]
        self.bins = [bins[d] for d in self.domains] if bins is not None else None
        self.targets = [targets[d] for d in self.domains] if targets is not None else [None] * len(self.domains)
        total = sum(weights[d] for d in self.domains)
        self.cumulative = np.cumsum([weights[d] / total for d in self.domains])
        self.choices = np.array(
            [len(b) for b in self.bins] if self.bins is not None else [len(s) - seq_len for s in self.streams]
        )
        self.seq_len, self.seed, self.start, self.rank, self.world_size = seq_len, seed, start, rank, world_size
        self.pad_id, self.batch_size = pad_id, batch_size

    def choose(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(domain numbers, window starts or bin numbers) of the global samples `indices`."""
        u = uniforms(self.seed, indices)
        domains = np.minimum(np.searchsorted(self.cumulative, u[:, 0], side="right"), len(self.domains) - 1)
        return domains, (u[:, 1] * self.choices[domains]).astype(np.int64)

    def sample(self, domain: int, item: int) -> dict[str, np.ndarray]:
        tokens = self.streams[domain]
        if self.bins is None:
            return window(tokens, item, self.seq_len)
        return packed(tokens, self.bins[domain][item], self.seq_len, self.pad_id, self.targets[domain])

    def batch(self, number: int) -> dict[str, torch.Tensor]:
        """This rank's batch `number` (counted from `start`)."""
        local = np.arange(number * self.batch_size, (number + 1) * self.batch_size)
        domains, items = self.choose(self.start + local * self.world_size + self.rank)
        rows = [self.sample(int(d), int(i)) for d, i in zip(domains, items)]
        return {key: torch.from_numpy(np.stack([row[key] for row in rows])) for key in rows[0]}

    def __iter__(self):
        worker = get_worker_info()
        number, step = (worker.id, worker.num_workers) if worker else (0, 1)
        while True:
            yield self.batch(number)
            number += step


class ShardDataModule(L.LightningDataModule):
    """packing: `truncate` (seq_len windows at random offsets), `best_fit` (whole documents per row, best-fit
    decreasing) or `pad` (one document per row, padded)."""

    dataset = MixtureWindows

    def __init__(
        self,
        path: str,
        seq_len: int,
        batch_size: int,
        mixture: dict[str, float],
        seed: int = 0,
        val_fraction: float = 0.02,
        val_windows: int = 16,
        phase: str = "pretrain",
        packing: str = "truncate",
        num_workers: int = 0,
    ):
        super().__init__()
        self.root = Path(path)
        self.path = self.root / "tokens"
        index_file = self.path / "shards.json"
        if not index_file.exists():
            raise FileNotFoundError(f"data.path: {index_file} not found; run task=prepare first")
        self.index = read_index(self.path)
        unknown = sorted(set(mixture) - set(self.index["domains"]))
        if unknown:
            raise ValueError(
                f"data.mixture names domains {unknown} that {self.path} does not have "
                f"(it has {sorted(self.index['domains'])})"
            )
        if packing not in PACKINGS:
            raise ValueError(f"data.packing={packing!r}: expected one of {list(PACKINGS)}")
        self.seq_len, self.batch_size, self.mixture, self.packing = seq_len, batch_size, dict(mixture), packing
        self.seed, self.val_fraction, self.val_windows, self.phase = seed, val_fraction, val_windows, phase
        self.num_workers = num_workers
        self.start_sample = 0
        self.streams: dict[str, DomainStream] = {}
        self.bins: dict[str, list] = {}
        self.val_bins: dict[str, list] = {}

    @property
    def vocab_size(self) -> int:
        return self.index["vocab_size"]

    @property
    def tokenizer_file(self) -> Path:
        """The dataset's tokenizer.json: what its tokens mean (exported beside the trained weights)."""
        return self.root / "tokenizer.json"

    @property
    def fingerprint(self) -> str:
        return self.index["fingerprint"]

    @property
    def pad_id(self) -> int:
        return self.index["eos_token_id"]

    # -- hooks for subclasses
    def targets(self, tokens: np.ndarray, offsets: np.ndarray) -> Callable | None:
        """(row ids, pieces) -> 1 where a token of a packed row is a training target, for the documents of
        `tokens` (None: every token; `packed` never trains across a document boundary)."""
        return None

    def document_bins(self, tokens: np.ndarray, offsets: np.ndarray) -> list[list[tuple[int, int]]]:
        """The rows of packed samples, as lists of (start, length) pieces of documents."""
        if self.packing == "best_fit":
            return best_fit_bins(offsets, self.seq_len + 1)
        return [[piece] for piece in document_pieces(offsets, self.seq_len + 1)]

    def samples_consumed(self) -> int:
        """Global samples this run has trained on: the data position saved in checkpoints."""
        return samples_consumed(self.trainer, self.seq_len)

    # --
    def setup(self, stage: str | None = None) -> None:
        for domain in self.mixture:
            if domain not in self.streams:
                tokens, offsets = load_shard(self.path, domain)
                self.streams[domain] = stream = DomainStream(tokens, offsets, self.val_fraction)
                if len(stream.train) <= self.seq_len:
                    raise ValueError(
                        f"domain {domain!r} has {len(stream.train)} training tokens, "
                        f"fewer than one window of seq_len={self.seq_len}"
                    )
                if self.packing != "truncate":
                    self.bins[domain] = self.document_bins(stream.train, stream.train_offsets)
                    self.val_bins[domain] = self.document_bins(stream.val, stream.val_offsets)[: self.val_windows]

    def train_dataloader(self) -> DataLoader:
        rank, world = data_parallel_rank_and_size(self.trainer) if self.trainer else (0, 1)  # TP ranks share data
        packed_rows = self.packing != "truncate"
        dataset = self.dataset(
            {d: s.train for d, s in self.streams.items()},
            self.mixture,
            self.seq_len,
            self.seed,
            self.start_sample,
            rank,
            world,
            bins=self.bins if packed_rows else None,
            pad_id=self.pad_id,
            batch_size=self.batch_size,
            targets={d: self.targets(s.train, s.train_offsets) for d, s in self.streams.items()},
        )
        return DataLoader(
            dataset, batch_size=None, num_workers=self.num_workers, persistent_workers=self.num_workers > 0
        )

    def val_dataloader(self) -> DataLoader:
        """The first val_windows windows (or packed rows) of each domain's held-out documents, the domains
        interleaved so that a limit on validation batches keeps every domain."""
        per_domain = []
        for domain, stream in self.streams.items():
            if self.packing == "truncate":
                starts = range(0, max(0, len(stream.val) - self.seq_len - 1), self.seq_len)
                per_domain.append([window(stream.val, s, self.seq_len) for s in list(starts)[: self.val_windows]])
            else:
                dataset = self.dataset(
                    {domain: stream.val},
                    {domain: 1.0},
                    self.seq_len,
                    self.seed,
                    0,
                    0,
                    1,
                    bins={domain: self.val_bins[domain]},
                    pad_id=self.pad_id,
                    targets={domain: self.targets(stream.val, stream.val_offsets)},
                )
                per_domain.append([dataset.sample(0, item) for item in range(len(self.val_bins[domain]))])
        samples = [s for row in itertools.zip_longest(*per_domain) for s in row if s is not None]
        return DataLoader(samples, batch_size=self.batch_size)

    def state_dict(self) -> dict:
        return {
            "phase": self.phase,
            "seed": self.seed,
            "fingerprint": self.fingerprint,
            "samples": self.samples_consumed(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["fingerprint"] != self.fingerprint:
            raise DataMismatchError(
                f"the checkpoint was trained on data with fingerprint {state['fingerprint']}, but {self.path} has "
                f"{self.fingerprint}: resume on the same prepared dataset, or start a new phase with init_from"
            )
        if state["seed"] != self.seed:
            raise DataMismatchError(f"the checkpoint's data seed is {state['seed']}, the config's {self.seed}")
        self.start_sample = state["samples"]
