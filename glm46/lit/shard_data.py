"""Training batches from prepared token shards: a domain mixture, random-truncation windows (pre-training)
or packed documents (mid-training, SFT), and sampling that is a pure function of (seed, sample index).

Global sample g goes to data-parallel rank g % world_size, so ranks never overlap; the position in
the stream is the number of samples the run has consumed (tokens seen / seq_len), so the
DataModule's checkpoint state is O(1): phase, seed, fingerprint, samples. A resume on shards with
another fingerprint fails instead of silently training on different data.

Every domain's last `val_fraction` of documents is held out: validation reads only those, training
never does. Subclasses (glm46.lit.sft_data, glm46.rl.prompts) change what a sample is through the
hooks `targets`, `document_bins` and `dataset`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import lightning as L
import numpy as np
from torch.utils.data import DataLoader

from glm46.data.shards import load_shard, read_index
from glm46.data.tokenizer import check_same_tokenizer
from glm46.data.windows import (
    DomainStream,
    MixtureWindows,
    best_fit_bins,
    check_mixture_domains,
    check_packing_choice,
    document_pieces,
    window,
)
from glm46.parallel.data_parallel import data_parallel_rank_and_size


def samples_consumed(trainer, seq_len: int) -> int:
    """Global samples a run has trained on (tokens seen / seq_len): the data position saved in checkpoints."""
    return (trainer.lightning_module.tokens_seen if trainer else 0) // seq_len


REPLAY = "replay/"  # the mixture's name of a domain of the replayed dataset


def read_index_of(root: Path, key: str) -> dict:
    """The shard index of the prepared dataset at `root`; FileNotFoundError naming `key` when there is none."""
    if not (root / "tokens" / "shards.json").exists():
        raise FileNotFoundError(f"{key}: {root / 'tokens' / 'shards.json'} not found; run task=prepare first")
    return read_index(root / "tokens")


class DataMismatchError(RuntimeError):
    """A checkpoint's data state does not fit the configured dataset."""


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
        replay: dict | None = None,
    ):
        """replay: {"path": another prepared dataset in the same tokenizer, "mixture": its domains -> weights}, sampled
        beside this one's domains as `replay/<domain>` (pre-training data replayed in SFT, so that it is not
        forgotten, as Megatron blends datasets); its weights are on the same scale as `mixture`'s."""
        super().__init__()
        self.root = Path(path)
        self.path = self.root / "tokens"
        self.index = read_index_of(self.root, "data.path")
        check_mixture_domains(mixture, self.index["domains"], self.root)
        check_packing_choice(packing)
        self.replay_root, self.replay_index = None, None
        mixture = {domain: weight for domain, weight in mixture.items() if weight > 0}  # 0: off
        if replay:
            self.replay_root = Path(replay["path"])
            self.replay_index = read_index_of(self.replay_root, "data.replay.path")
            check_same_tokenizer(
                ("data.path", self.tokenizer_file), ("data.replay.path", self.replay_root / "tokenizer.json")
            )
            check_mixture_domains(replay["mixture"], self.replay_index["domains"], self.replay_root)
            mixture |= {f"{REPLAY}{domain}": weight for domain, weight in replay["mixture"].items() if weight > 0}
        self.seq_len, self.batch_size, self.mixture, self.packing = seq_len, batch_size, mixture, packing
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
        if self.replay_index is None:
            return self.index["fingerprint"]
        return f"{self.index['fingerprint']}+{self.replay_index['fingerprint']}"

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
                replayed = domain.startswith(REPLAY)
                tokens, offsets = load_shard(
                    self.replay_root / "tokens" if replayed else self.path, domain.removeprefix(REPLAY)
                )
                self.streams[domain] = stream = DomainStream(tokens, offsets, self.val_fraction)
                if len(stream.train) <= self.seq_len:
                    raise ValueError(
                        f"domain {domain!r} has {len(stream.train)} training tokens, "
                        f"fewer than one window of seq_len={self.seq_len}"
                    )
                if self.packing != "truncate":
                    self.bins[domain] = self.document_bins(stream.train, stream.train_offsets)
                    self.val_bins[domain] = self.document_bins(stream.val, stream.val_offsets)[: self.val_windows]

    def train_dataset(self, rank: int, world: int) -> MixtureWindows:
        """This data-parallel rank's endless training samples."""
        return self.dataset(
            {d: s.train for d, s in self.streams.items()},
            self.mixture,
            self.seq_len,
            self.seed,
            self.start_sample,
            rank,
            world,
            bins=self.bins if self.packing != "truncate" else None,
            pad_id=self.pad_id,
            batch_size=self.batch_size,
            targets={d: self.targets(s.train, s.train_offsets) for d, s in self.streams.items()},
        )

    def val_dataset(self, domain: str) -> MixtureWindows:
        """The held-out packed rows of one domain, each sampled by its number (`sample(0, item)`)."""
        stream = self.streams[domain]
        return self.dataset(
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

    def train_dataloader(self) -> DataLoader:
        rank, world = data_parallel_rank_and_size(self.trainer) if self.trainer else (0, 1)  # TP ranks share data
        return DataLoader(
            self.train_dataset(rank, world),
            batch_size=None,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
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
                dataset = self.val_dataset(domain)
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
