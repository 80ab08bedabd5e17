"""Preference batches: the pairs of a prepared `source=preference` dataset (glm46.data.preference), each sample the
chosen and the rejected conversation of one pair, right-padded to seq_len:

    batch = {"chosen_ids": [B, seq_len], "rejected_ids": [B, seq_len],
             "chosen_mask": [B, seq_len], "rejected_mask": [B, seq_len],    # 1 on the reply tokens the model writes
             "chosen_length": [B], "rejected_length": [B], "prompt_length": [B]}

A reply's tokens are its assistant tokens after the prompt (glm46.data.chat.assistant_mask: tool results inside a
reply are not the model's), up to and including the token that closes its last turn; the reward model reads its
score there, at `length - 1`. Pairs whose longer side exceeds seq_len are left out (a truncated reply would be
judged without its end), counted: setup logs how many training and held-out pairs of each domain were, and keeps the
totals in `dropped_overlong`; a domain none of whose training pairs fits is an error.

With `reference` set (DPO: the starting policy's summed reply log-probs of every pair, computed once before
training), each sample also holds its pair's `ref_chosen_logps` and `ref_rejected_logps`; the table is part of the
DataModule's state, so that a resumed run reads the reference it started with.

Sampling, the rank split, the held-out pairs (validation) and the resumable position are ShardDataModule's; the
position counts pairs (the preference modules count seq_len tokens per pair in `tokens_seen`).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from glm46.data.chat import ChatTokens, assistant_mask, reply_starts
from glm46.data.tokenizer import GLMTokenizer
from glm46.data.windows import MixtureWindows
from glm46.lit.shard_data import ShardDataModule
from glm46.logs import rank_zero_logger

log = rank_zero_logger(__name__)

SIDES = ("chosen", "rejected")
REFERENCE = ("ref_chosen_logps", "ref_rejected_logps")


def split_pair(document: np.ndarray, chat: ChatTokens) -> tuple[np.ndarray, np.ndarray, int]:
    """A pair's tokens (glm46.data.preference) -> (the chosen conversation, the rejected one, the prompt's length):
    the chosen runs to the first <|endoftext|>, the rejected is the prompt before its <|assistant|> and the tokens
    after that <|endoftext|> (which open with the rejected reply's <|assistant|>)."""
    middle = int(np.flatnonzero(document == chat.eos)[0])
    chosen = document[: middle + 1]
    prompt_length = int(reply_starts(chosen, chat)[-1])
    return chosen, np.concatenate([chosen[: prompt_length - 1], document[middle + 1 :]]), prompt_length


def reply_mask(ids: np.ndarray, prompt_length: int, chat: ChatTokens) -> np.ndarray:
    """1 on the tokens of a conversation's reply the model writes: its assistant tokens after the prompt."""
    mask = assistant_mask(ids, chat)
    mask[:prompt_length] = 0
    return mask


def pair_lengths(tokens: np.ndarray, offsets: np.ndarray, chat: ChatTokens) -> np.ndarray:
    """The length of each pair's longer side, in tokens, for the pairs of a domain's tokens; ValueError when the
    documents are no pairs."""
    ends = np.flatnonzero(tokens == chat.eos)
    middle = ends[~np.isin(ends + 1, offsets[1:])]  # each pair's first <|endoftext|>: the chosen side's end
    document = np.searchsorted(offsets, middle, side="right") - 1
    if len(middle) != len(offsets) - 1 or (np.diff(document) != 1).any():
        raise ValueError("documents that are no preference pairs (prepare them with source=preference)")
    starts = reply_starts(tokens, chat)  # the rejected reply opens no reply (no <|user|> before it)
    prompt_end = starts[np.searchsorted(starts, middle) - 1]
    return np.maximum(middle + 1 - offsets[:-1], prompt_end - 1 - offsets[:-1] + offsets[1:] - middle - 1)


def pair_bins(tokens: np.ndarray, offsets: np.ndarray, seq_len: int, chat: ChatTokens) -> list[list[tuple[int, int]]]:
    """The pairs of a domain's tokens whose sides both fit seq_len, one per bin [(start, length)]; ValueError when
    the documents are no pairs."""
    fits = np.flatnonzero(pair_lengths(tokens, offsets, chat) <= seq_len)
    return [[(int(offsets[d]), int(offsets[d + 1] - offsets[d]))] for d in fits]


class Pairs(MixtureWindows):
    """MixtureWindows whose bins are single pairs, sampled as the two padded sides."""

    def __init__(self, *args, chat: ChatTokens, **kwargs):
        super().__init__(*args, **kwargs)
        self.chat = chat
        self.reference: list[np.ndarray] | None = None  # per domain: [bins, 2] (chosen, rejected) log-probs
        self.shuffled = False  # the label control: every other draw's sides swapped (`batch`)

    def sample(self, domain: int, item: int) -> dict[str, np.ndarray]:
        ((start, length),) = self.bins[domain][item]
        *sides, prompt_length = split_pair(
            np.asarray(self.streams[domain][start : start + length], dtype=np.int64), self.chat
        )
        row = {"prompt_length": np.int64(prompt_length)}
        for name, ids in zip(SIDES, sides):
            padded = np.full(self.seq_len, self.pad_id, dtype=np.int64)
            padded[: len(ids)] = ids
            mask = np.zeros(self.seq_len, dtype=np.int64)
            mask[: len(ids)] = reply_mask(ids, prompt_length, self.chat)
            row |= {f"{name}_ids": padded, f"{name}_mask": mask, f"{name}_length": np.int64(len(ids))}
        if self.reference is not None:
            row[REFERENCE[0]], row[REFERENCE[1]] = self.reference[domain][item]
        return row

    def batch(self, number: int) -> dict[str, torch.Tensor]:
        """MixtureWindows' batch; shuffled, the sides of this rank's odd-numbered draws swapped. Draws pick pairs at
        random, so which pairs swap carries nothing of their content, and every two draws hold one of each: with a
        coin per pair instead, the draws' chance excess of one orientation (607 kept to 593 swapped in a 150-step
        toy run) is learnt along the direction in which every chosen reply differs from its rejected one, and the
        control ranked held-out pairs 0.68 right, though its mean margin was 0.004."""
        batch = super().batch(number)
        if self.shuffled:
            swap = torch.from_numpy((np.arange(number * self.batch_size, (number + 1) * self.batch_size) % 2) == 1)
            for chosen, rejected in [(f"chosen_{f}", f"rejected_{f}") for f in ("ids", "mask", "length")] + [REFERENCE]:
                if chosen in batch:
                    batch[chosen][swap], batch[rejected][swap] = batch[rejected][swap], batch[chosen][swap]
        return batch


class PreferenceDataModule(ShardDataModule):
    """seq_len is the longest side served: pairs with a longer one are left out."""

    def __init__(
        self,
        path: str,
        seq_len: int,
        batch_size: int,
        mixture: dict[str, float],
        seed: int = 0,
        val_fraction: float = 0.1,
        val_windows: int = 64,
        phase: str = "preference",
        num_workers: int = 0,
        shuffle_labels: bool = False,
    ):
        """shuffle_labels: the training pairs' sides swapped at random (a control whose labels carry no preference:
        a reward model trained on them should rank held-out pairs at chance); the held-out pairs keep theirs."""
        super().__init__(path, seq_len, batch_size, mixture, seed, val_fraction, val_windows, phase, "pad", num_workers)
        self.shuffle_labels = shuffle_labels
        self.chat = ChatTokens(GLMTokenizer.from_file(self.root / "tokenizer.json"))
        self.dataset = partial(Pairs, chat=self.chat)
        self.reference: dict[str, dict[str, np.ndarray]] | None = None  # split -> domain -> [bins, 2]
        self.dropped_overlong = {"train": 0, "val": 0}  # the pairs left out for a side longer than seq_len

    def document_bins(self, tokens: np.ndarray, offsets: np.ndarray) -> list[list[tuple[int, int]]]:
        """The pairs whose sides both fit seq_len, one per bin."""
        try:
            return pair_bins(tokens, offsets, self.seq_len, self.chat)
        except ValueError as error:
            raise ValueError(f"data.path: {self.root} holds {error}") from None

    def setup(self, stage: str | None = None) -> None:
        new = [domain for domain in self.mixture if domain not in self.streams]
        super().setup(stage)
        for domain in new:
            self.count_overlong(domain)

    def count_overlong(self, domain: str) -> None:
        """Count and log a domain's pairs left out for length (its documents are pairs: document_bins read them);
        ValueError when none of its training pairs fits."""
        stream = self.streams[domain]
        pairs = {"train": len(stream.train_offsets) - 1, "val": len(stream.val_offsets) - 1}
        if not self.bins[domain]:
            lengths = pair_lengths(stream.train, stream.train_offsets, self.chat)
            raise ValueError(
                f"domain {domain!r}: every one of its {pairs['train']} training pairs has a side longer than "
                f"data.seq_len={self.seq_len} (the shortest pair's longer side: {lengths.min()} tokens, the longest "
                f"side: {lengths.max()}); raise data.seq_len"
            )
        dropped = {
            "train": pairs["train"] - len(self.bins[domain]),
            "val": int((pair_lengths(stream.val, stream.val_offsets, self.chat) > self.seq_len).sum()),
        }
        for split in dropped:
            self.dropped_overlong[split] += dropped[split]
        if any(dropped.values()):
            log.info(
                f"domain {domain!r}: {dropped['train']} of {pairs['train']} training and {dropped['val']} of "
                f"{pairs['val']} held-out preference pairs left out, a side longer than data.seq_len={self.seq_len}"
            )

    def train_dataset(self, rank: int, world: int) -> Pairs:
        pairs = self.with_reference(super().train_dataset(rank, world), "train")
        pairs.shuffled = self.shuffle_labels
        return pairs

    def val_dataset(self, domain: str) -> Pairs:
        return self.with_reference(super().val_dataset(domain), "val")

    def with_reference(self, pairs: Pairs, split: str) -> Pairs:
        if self.reference is not None:
            pairs.reference = [self.reference[split][domain] for domain in pairs.domains]
        return pairs

    def every_pair(self) -> dict[str, dict[str, Pairs]]:
        """split ("train", "val") -> domain -> its pairs alone, each sampled by its number (`sample(0, item)`) and
        without reference: what a reference table is computed over, aligned with it."""

        def pairs(domain: str, tokens: np.ndarray, bins: list) -> Pairs:
            return Pairs({domain: tokens}, {domain: 1.0}, self.seq_len, self.seed, 0, 0, 1, bins={domain: bins},
                         pad_id=self.pad_id, chat=self.chat)  # fmt: skip

        return {
            "train": {d: pairs(d, stream.train, self.bins[d]) for d, stream in self.streams.items()},
            "val": {d: pairs(d, stream.val, self.val_bins[d]) for d, stream in self.streams.items()},
        }

    def state_dict(self) -> dict:
        """ShardDataModule's, and the reference table as tensors (checkpoints are read without unpickling arrays)."""
        reference = None
        if self.reference is not None:
            reference = {
                s: {d: torch.from_numpy(t) for d, t in domains.items()} for s, domains in self.reference.items()
            }
        return super().state_dict() | {"reference": reference}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if state.get("reference") is not None:
            self.reference = {
                s: {d: t.numpy() for d, t in domains.items()} for s, domains in state["reference"].items()
            }
