"""Training samples from token streams: a domain's held-out tail, documents packed into rows, windows at random
offsets, and a domain mixture sampled as a pure function of (seed, sample index).

Global sample g goes to data-parallel rank g % world_size, so ranks never overlap, and the sampler's position
is one integer (the samples consumed): the DataModules over these (glm46.lit.shard_data) save only that.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from glm46.errors import ConfigError
from glm46.modules.loss import IGNORE_INDEX

PACKINGS = ("truncate", "best_fit", "pad")


def check_packing_choice(packing: str) -> None:
    """data.packing names one of PACKINGS (checked at composition and by the DataModule)."""
    if packing not in PACKINGS:
        raise ConfigError(f"data.packing={packing!r} (phase.packing) is not one of {list(PACKINGS)}")


def check_mixture_domains(mixture: dict[str, float], domains: list[str], path) -> None:
    """Every domain the mixture weighs is one the prepared dataset at data.path has (checked at composition, when
    the dataset is on this machine, and by the DataModule). A weight of 0 turns a domain off, named or not: a phase's
    mixture merges its parent's, so a child phase drops a domain by weighing it 0."""
    unknown = sorted(d for d, weight in mixture.items() if weight > 0 and d not in domains)
    if unknown:
        raise ConfigError(
            f"data.mixture (phase.mixture) names domains {unknown} that data.path={path} does not have "
            f"(it has {sorted(domains)})"
        )


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

    def indices(self, number: int) -> np.ndarray:
        """The global sample indices of this rank's batch `number` (counted from `start`)."""
        local = np.arange(number * self.batch_size, (number + 1) * self.batch_size)
        return self.start + local * self.world_size + self.rank

    def batch(self, number: int) -> dict[str, torch.Tensor]:
        """This rank's batch `number` (counted from `start`)."""
        domains, items = self.choose(self.indices(number))
        rows = [self.sample(int(d), int(i)) for d, i in zip(domains, items)]
        return {key: torch.from_numpy(np.stack([row[key] for row in rows])) for key in rows[0]}

    def __iter__(self):
        worker = get_worker_info()
        number, step = (worker.id, worker.num_workers) if worker else (0, 1)
        while True:
            yield self.batch(number)
            number += step
