"""`task=score`: a reward model's pairwise accuracy on prepared preference pairs (source=preference), the share of
pairs whose chosen reply it scores above the rejected one, with its 95% Wilson interval:

    python run.py task=score score.model=<RM run or export> score.data=<prepared preference dir>
    pairwise_accuracy: 0.912 (95% CI [0.870, 0.941]) n=250

`score.split=val` scores the pairs every preference DataModule holds out (the last data.val_fraction of each
domain's pairs, glm46.data.windows.DomainStream), `all` every pair. Pairs with a side longer than score.seq_len are
left out and counted. The result, with each pair's outcome (for paired comparisons), goes to <run dir>/score.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from glm46.data.chat import ChatTokens
from glm46.data.shards import load_shard, read_index
from glm46.data.tokenizer import GLMTokenizer
from glm46.data.windows import DomainStream
from glm46.intervals import interval
from glm46.lit.preference_data import Pairs, pair_bins
from glm46.rl.reward_export import RewardModel, load_reward_model


def held_out_pairs(
    data: Path, split: str, val_fraction: float, seq_len: int, domains: list[str] | None = None
) -> tuple[list[dict], int]:
    """(every pair of the split as Pairs samples, in domain and document order; the pairs left out as too long), of
    `domains` (None: every domain of the dataset)."""
    chat = ChatTokens(GLMTokenizer.from_file(data / "tokenizer.json"))
    index = read_index(data / "tokens")
    samples, too_long = [], 0
    for domain in sorted(domains or index["domains"]):
        tokens, offsets = load_shard(data / "tokens", domain)
        if split == "val":
            stream = DomainStream(tokens, offsets, val_fraction)
            tokens, offsets = stream.val, stream.val_offsets
        bins = pair_bins(np.asarray(tokens), offsets, seq_len, chat)
        too_long += len(offsets) - 1 - len(bins)
        pairs = Pairs(
            {domain: tokens}, {domain: 1.0}, seq_len, 0, 0, 0, 1, {domain: bins}, index["eos_token_id"], chat=chat
        )
        samples += [pairs.sample(0, item) for item in range(len(bins))]
    return samples, too_long


def held_out_scoring(cfg: DictConfig, model: Path) -> DictConfig:
    """The score settings of a reward model trained by `cfg` (module=reward_model): its data's held-out pairs."""
    data = cfg.data
    return OmegaConf.create(
        {"model": str(model), "data": data.path, "split": "val", "val_fraction": data.val_fraction,
         "seq_len": data.seq_len, "batch_size": cfg.score.batch_size,
         "domains": [domain for domain, weight in data.mixture.items() if weight > 0]}
    )  # fmt: skip


def pair_outcomes(model: RewardModel, samples: list[dict], batch_size: int) -> tuple[list[int], list[float]]:
    """(1 where the chosen side scores higher, else 0; the reward differences), pair by pair."""
    correct, differences = [], []
    for start in range(0, len(samples), batch_size):
        rows = samples[start : start + batch_size]
        batch = {key: torch.from_numpy(np.stack([row[key] for row in rows])) for key in rows[0]}
        chosen = model.score(batch["chosen_ids"], batch["chosen_length"])
        rejected = model.score(batch["rejected_ids"], batch["rejected_length"])
        differences += (chosen - rejected).tolist()
        correct += (chosen > rejected).long().tolist()
    return correct, differences


def score(settings, output_dir: Path) -> dict:
    """Score `settings.data` with the reward model of `settings.model`; print the accuracy line, write score.json."""
    model = load_reward_model(settings.model)
    samples, too_long = held_out_pairs(
        Path(settings.data), settings.split, settings.val_fraction, settings.seq_len, settings.get("domains")
    )
    correct, differences = pair_outcomes(model, samples, settings.batch_size)
    n = len(correct)
    accuracy = sum(correct) / max(n, 1)
    low, high = interval(accuracy, n)
    print(f"pairwise_accuracy: {accuracy:.3f} (95% CI [{low:.3f}, {high:.3f}]) n={n}", flush=True)
    result = {
        "pairwise_accuracy": accuracy,
        "ci95": [low, high],
        "n": n,
        "too_long": too_long,
        "mean_margin": float(np.mean(differences)) if differences else 0.0,
        "model": str(model.path),
        "data": str(settings.data),
        "split": str(settings.split),
        "correct": correct,
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "score.json").write_text(json.dumps(result) + "\n")
    return result
