"""DCLM's quality classifier as two stages of a preparation (`prepare.quality_classifier`, docs/data.md):

    quality_model      [1]  trains fastText classifiers (glm46.data.scorers.fasttext_quality) on the kept documents
                            of `reference_domains` (hq) against those of the other scored `domains` (cc, the raw
                            pool), one without each of `folds` folds of the pool; or copies the given `model`
                            and, for `keep_fraction`, the score its top fraction of the first `threshold_sample`
                            scored documents is above (DCLM keeps a percentile, not a fixed probability)
    quality_classifier [N]  per read task, each kept document of `domains` scored by its probability of hq (by the
                            classifier that did not train on its fold); those below `min_score`, or below that
                            percentile, dropped (reason `quality_classifier`)

It runs after the perplexity filter, on what it kept."""

from __future__ import annotations

import hashlib
import shutil
from functools import partial
from itertools import islice
from pathlib import Path

import numpy as np

from glm46.errors import ConfigError

from ..cache import filter_on
from ..scorers.fasttext_quality import QualityClassifier, check_model_file, fold_of, train_classifier
from .verdicts import judge, kept_texts
from .work import StagedPlan

HYPERPARAMETERS = {"lr", "dim", "ws", "epoch", "minCount", "wordNgrams", "minn", "maxn", "bucket", "loss"}


def check_quality_classifier(settings: dict | None) -> None:
    """prepare.quality_classifier, before anything runs: a probability for `min_score`, fastText's own
    hyperparameter names, a model file that starts as a fastText model; a ConfigError naming the key otherwise."""
    if not filter_on("quality_classifier", settings):
        return
    key = "prepare.quality_classifier"
    limit, fraction = settings.get("min_score"), settings.get("keep_fraction")
    if limit is not None and not 0 <= limit < 1:
        raise ConfigError(f"{key}.min_score={limit}: a probability from 0 to below 1 (or null: score, drop nothing)")
    if fraction is not None and (limit is not None or not 0 < fraction <= 1):
        raise ConfigError(
            f"{key}.keep_fraction={fraction}: a share above 0, at most 1, in place of min_score (here {limit})"
        )
    if settings["folds"] < 1:
        raise ConfigError(f"{key}.folds={settings['folds']}: at least 1 (1: one classifier, scoring what it saw)")
    unknown = sorted(set(settings.get("hyperparameters") or {}) - HYPERPARAMETERS)
    if unknown:
        raise ConfigError(f"{key}.hyperparameters: {unknown} are not fastText's; it takes {sorted(HYPERPARAMETERS)}")
    if settings.get("model"):
        try:
            check_model_file(settings["model"])
        except (OSError, ValueError) as error:
            message = f"{key}.model={settings['model']}: cannot be read as a fastText model ({error})"
            raise ConfigError(message) from None


def _kept(plan: StagedPlan, domains: list[str], limit: int | None = None) -> list[str]:
    """The first `limit` (all: None) texts of the documents of `domains` kept before the classifier, in input order."""
    return list(islice(kept_texts(plan, domains, "quality_model"), limit))


def _pools(plan: StagedPlan, domains: list[str], folds: int, limit: int) -> list[list[str]]:
    """For each fold, the first `limit` kept texts of `domains` outside it (with one fold, the first `limit`): the
    pool each classifier trains on, read once and only until every fold has its `limit`, never the whole pool."""
    pools = [[] for _ in range(folds)]
    for text in kept_texts(plan, domains, "quality_model"):
        own = fold_of(text, folds) if folds > 1 else None
        for fold, pool in enumerate(pools):
            if fold != own and len(pool) < limit:
                pool.append(text)
        if all(len(pool) == limit for pool in pools):
            break
    return pools


def quality_model(plan: StagedPlan, index: int, folder: Path) -> dict:
    settings = plan.quality_classifier
    if settings.get("model"):
        shutil.copyfile(settings["model"], folder / "model-0.bin")
        examples = [0]
    else:
        reference_domains = list(settings["reference_domains"])
        pool_domains = [d for d in settings["domains"] if d not in reference_domains]
        limit = int(settings["max_documents"])
        reference, folds = _kept(plan, reference_domains, limit), int(settings["folds"])
        if not reference:
            raise ConfigError(
                f"prepare.quality_classifier.reference_domains={reference_domains}: no document of these domains is "
                f"left to train on"
            )
        examples = []
        for fold, others in enumerate(_pools(plan, pool_domains, folds, limit)):
            if not others:
                without = f" without fold {fold} of {folds}" if folds > 1 else ""
                raise ConfigError(
                    f"prepare.quality_classifier.domains={pool_domains} (outside reference_domains): no document left "
                    f"to train on as the pool{without}"
                )
            path, hyperparameters = folder / f"model-{fold}.bin", dict(settings["hyperparameters"])
            try:
                count = train_classifier(reference, others, path, hyperparameters, settings["seed"])
            except RuntimeError as error:  # fastText's "Encountered NaN": a rate too high for these documents
                raise ConfigError(
                    f"prepare.quality_classifier.hyperparameters={hyperparameters}: fastText's training diverged "
                    f"({error}); lower lr"
                ) from None
            examples.append(count)
    try:
        models = [QualityClassifier(path) for path in _models(folder)]
    except ValueError as error:
        raise ConfigError(f"prepare.quality_classifier.model={settings['model']}: {error}") from None
    digests = [hashlib.sha256(path.read_bytes()).hexdigest() for path in _models(folder)]
    stats = {"documents": sum(examples), "trained": examples, "sha256": digests}  # trained: per class, per model
    if settings.get("keep_fraction") is not None:  # the percentile's score, from the first scored documents
        sample = _kept(plan, list(settings["domains"]), settings["threshold_sample"])
        scores = score_with(models, sample)
        stats["min_score"] = float(np.quantile(scores, 1 - settings["keep_fraction"])) if scores else 0.0
    return stats


def _models(folder: Path) -> list[Path]:
    return sorted(folder.glob("model-*.bin"), key=lambda path: int(path.stem.split("-")[1]))


def score_with(models: list[QualityClassifier], texts: list[str]) -> list[float]:
    """Each text's probability of hq by the classifier of its fold (the one that did not train on it)."""
    folds = [fold_of(text, len(models)) for text in texts]
    found = {fold: iter(models[fold].scores([t for t, f in zip(texts, folds) if f == fold])) for fold in set(folds)}
    return [next(found[fold]) for fold in folds]


def quality_classifier(plan: StagedPlan, reader: int, folder: Path) -> dict:
    trained = plan.task_dir("quality_model", 0)
    models = [QualityClassifier(path) for path in _models(trained)]
    limit = plan.stats("quality_model", 0).get("min_score", plan.quality_classifier.get("min_score"))
    drop = (lambda values: values < limit) if limit is not None else None
    score = partial(score_with, models)
    return judge(plan, reader, folder, "quality_classifier", plan.quality_classifier["domains"], score, drop)
