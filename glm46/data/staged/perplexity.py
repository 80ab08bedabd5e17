"""CCNet's perplexity filter (Wenzek et al., 2019, arXiv:1911.00359) as two stages of a preparation
(`prepare.perplexity`, docs/data.md):

    perplexity_model [1]  fits a word n-gram model (glm46.data.scorers.ngram) on the kept documents of
                          `reference_domains`, or reads the ARPA file `model`; and the bucket cutoffs: the
                          `buckets` quantiles of the perplexity of the first `bucket_sample` scored documents
                          (input order), as CCNet cuts its head, middle and tail on a sample
    perplexity       [N]  per read task, the perplexity of each kept document of the scored `domains`; those
                          above `max` dropped (reason `perplexity`)

The scores travel with the documents: a kept one's line gets `perplexity` and `perplexity_bucket`, an excluded one
its `score`. Documents of other domains are not scored (code under a prose model would all be "tail")."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np

from glm46.errors import ConfigError

from ..cache import filter_on
from ..scorers.ngram import KenLMScorer, arpa_counts, fit_kneser_ney
from .verdicts import judge, kept_texts
from .work import StagedPlan

BUCKETS = ("head", "middle", "tail")


def model_counts(path: str) -> dict[int, int]:
    """The n-gram counts of the ARPA file `prepare.perplexity.model`, or a ConfigError naming the key."""
    try:
        return arpa_counts(path)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ConfigError(f"prepare.perplexity.model={path}: cannot be read as an ARPA model ({error})") from None


def check_perplexity(settings: dict | None) -> None:
    """prepare.perplexity, before anything runs: an order of at least 1, two bucket quantiles, a positive `max`, a
    model with an ARPA header; a ConfigError naming the key otherwise."""
    if not filter_on("perplexity", settings):
        return
    if settings["order"] < 1:
        raise ConfigError(f"prepare.perplexity.order={settings['order']}: an n-gram model's order is at least 1")
    buckets = list(settings["buckets"])
    if len(buckets) != 2 or not 0 < buckets[0] < buckets[1] < 1:
        raise ConfigError(
            f"prepare.perplexity.buckets={buckets}: two quantiles 0 < a < b < 1 (head below a, tail above b)"
        )
    if settings.get("max") is not None and settings["max"] <= 0:
        raise ConfigError(f"prepare.perplexity.max={settings['max']}: a perplexity is positive (or null: no drop)")
    if settings.get("model"):
        model_counts(settings["model"])


def perplexity_model(plan: StagedPlan, index: int, folder: Path) -> dict:
    settings = plan.perplexity
    if settings.get("model"):
        shutil.copyfile(settings["model"], folder / "model.arpa")
        reference = 0
    else:
        texts = list(kept_texts(plan, list(settings["reference_domains"]), "perplexity_model"))
        if not texts:
            raise ConfigError(
                f"prepare.perplexity.reference_domains={list(settings['reference_domains'])}: no document of these "
                f"domains is left to fit the model on"
            )
        fit_kneser_ney(texts, int(settings["order"])).write_arpa(folder / "model.arpa")
        reference = len(texts)
    scorer, sample = KenLMScorer(folder / "model.arpa"), []
    for text in kept_texts(plan, list(settings["domains"]), "perplexity_model"):
        if len(sample) == int(settings["bucket_sample"]):
            break
        sample.append(scorer.perplexity(text))
    cutoffs = np.quantile(sample, list(settings["buckets"])).tolist() if sample else []
    (folder / "cutoffs.json").write_text(json.dumps(cutoffs))
    return {
        "documents": reference,
        "ngrams": sum(model_counts(folder / "model.arpa").values()),
        "sha256": hashlib.sha256((folder / "model.arpa").read_bytes()).hexdigest(),
        "cutoffs": cutoffs,
    }


def perplexity(plan: StagedPlan, reader: int, folder: Path) -> dict:
    model, limit = KenLMScorer(plan.task_dir("perplexity_model", 0) / "model.arpa"), plan.perplexity.get("max")
    drop = (lambda values: values > limit) if limit is not None else None

    def score(texts: list[str]) -> list[float]:
        return [model.perplexity(text) for text in texts]

    return judge(plan, reader, folder, "perplexity", plan.perplexity["domains"], score, drop)


def cutoffs(plan: StagedPlan) -> list[float]:
    """The bucket cutoffs of the plan's perplexity filter; none without it."""
    if "perplexity" not in plan.stages:
        return []
    return json.loads((plan.task_dir("perplexity_model", 0) / "cutoffs.json").read_text())


def with_perplexity(line: str, value: float | None, cutoffs: list[float]) -> str:
    """A kept document's line with its perplexity and CCNet's bucket (head below the first cutoff, tail above the
    second); as it was where it was not scored."""
    if value is None:
        return line
    bucket = BUCKETS[int(np.searchsorted(cutoffs, value, side="right"))] if cutoffs else None
    return json.dumps(json.loads(line) | {"perplexity": round(value, 3), "perplexity_bucket": bucket}) + "\n"
