"""DCLM's quality classifier (prepare.quality_classifier): trained on reference prose against the pool, it drops
web boilerplate and keeps held-out prose and benign technical text, the same over 2 tasks as in one process (the
model trained on one thread is the same file); a given model scores in its place; a model file that cannot be read
is refused naming the key."""

from __future__ import annotations

import json
import random
from functools import partial

import pytest

from bench.planted_docs import TECHNICAL, paragraphs, spam
from glm46.data.scorers.fasttext_quality import QualityClassifier, train_classifier
from glm46.errors import ConfigError

from .test_prepare_staged import assert_same_dataset, excluded_records, prepare_filtered, reference_and_pool, staged

PARAGRAPHS = paragraphs()
REFERENCE, HELD_OUT = PARAGRAPHS[:-120], PARAGRAPHS[-120:]
# DCLM's training script's defaults learn nothing from hundreds of documents (every score 0.5): a higher rate; and
# 100,000 n-gram buckets, not fastText's 2,000,000 (800 MB per model at dim 100)
SETTINGS = {
    "reference_domains": ["docs"],
    "domains": ["general"],
    "min_score": 0.4,
    "max_documents": 200000,
    "folds": 2,
    "seed": 0,
    "hyperparameters": {"lr": 1.0, "dim": 100, "ws": 5, "epoch": 10, "minCount": 1, "wordNgrams": 2, "bucket": 100000},
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Reference prose (domain docs); a pool (general) of held-out prose, prose with violent technical verbs and
    web boilerplate."""
    rng, folder = random.Random(3), tmp_path_factory.mktemp("classifier") / "in"
    folder.mkdir()
    pool = [{"text": text, "id": f"prose-{i}"} for i, text in enumerate(HELD_OUT[:60])]
    pool += [{"text": f"{text}\n{TECHNICAL[i % 3]}", "id": f"technical-{i}"} for i, text in enumerate(HELD_OUT[60:80])]
    pool += [{"text": spam(rng), "id": f"spam-{i}"} for i in range(40)]
    rng.shuffle(pool)
    return reference_and_pool(folder, REFERENCE, pool)


def _prepare(source, output, tasks: int = 1, quality_classifier=None, **settings):
    return prepare_filtered(source, output, tasks, quality_classifier=(quality_classifier or SETTINGS) | settings)


def _dropped_before(output) -> set[str]:
    """The ids of the documents dropped before the classifier (deduplication, the rules)."""
    found = {json.loads(line)["id"] for f in (output / "excluded").rglob("*.jsonl") for line in f.open()}
    return found - {r["id"] for r in excluded_records(output, "quality_classifier")}


def test_boilerplate_is_dropped_and_prose_kept_the_same_over_two_tasks(planted, tmp_path):
    output = _prepare(planted, tmp_path / "one")
    manifest = json.loads((output / "manifest.json").read_text())
    excluded = excluded_records(output, "quality_classifier")
    spams = {f"spam-{i}" for i in range(40)} - _dropped_before(output)
    assert len(spams) >= 30 and {r["id"] for r in excluded} == spams  # every one that reached it, nothing else
    assert manifest["dropped"]["quality_classifier"] == len(excluded) and all(r["score"] < 0.4 for r in excluded)
    kept = {json.loads(line)["id"] for line in (output / "documents" / "general.jsonl").open()}
    assert {f"technical-{i}" for i in range(20)} <= kept and len({k for k in kept if k.startswith("prose-")}) >= 55
    fitted = manifest["models"]["quality_classifier"]
    pool = manifest["domains"]["general"]["documents"] + len(excluded)
    assert len(fitted["sha256"]) == 2 and sum(fitted["trained"]) == pool  # each fold trained the other classifier
    assert_same_dataset(_prepare(planted, tmp_path / "two", tasks=2), output)


def test_a_given_model_scores_in_place_of_a_trained_one(planted, tmp_path):
    model, rng = tmp_path / "model.bin", random.Random(4)
    train_classifier(REFERENCE[:100], [spam(rng) for _ in range(100)], model, SETTINGS["hyperparameters"], seed=0)
    output = _prepare(planted, tmp_path / "given", model=str(model), reference_domains=[])
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["models"]["quality_classifier"]["trained"] == [0]
    excluded = excluded_records(output, "quality_classifier")
    assert excluded and all(r["id"].startswith("spam-") for r in excluded)
    scores = QualityClassifier(model).scores([r["text"] for r in excluded])
    assert [r["score"] for r in excluded] == pytest.approx(scores, abs=1e-6)


def test_a_model_file_that_cannot_be_read_is_refused_naming_the_key(planted, tmp_path):
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"not a fastText model")
    for path in (bad, tmp_path / "missing.bin"):
        with pytest.raises(ConfigError, match=rf"prepare\.quality_classifier\.model={path}: cannot be read"):
            _prepare(planted, tmp_path / "out", model=str(path), reference_domains=[])
    assert not (tmp_path / "out" / "manifest.json").exists()  # refused before a document was read


def test_a_diverging_training_names_its_hyperparameters(planted, tmp_path):
    """In this process, and from a task process of its own: the setting is named, not a failed task to rerun."""
    diverging = SETTINGS | {"hyperparameters": SETTINGS["hyperparameters"] | {"lr": 100.0}}
    for run, prepare in enumerate([_prepare, partial(staged, tasks=2, workers=2)]):
        with pytest.raises(ConfigError, match=r"^prepare\.quality_classifier\.hyperparameters=.*diverged.*lower lr$"):
            prepare(planted, tmp_path / f"run-{run}", quality_classifier=diverging)


def test_keep_fraction_cuts_at_the_percentile_of_the_scored_documents(planted, tmp_path):
    """DCLM's threshold: the top share kept, the cut the scores' percentile (here over every scored document)."""
    output = _prepare(planted, tmp_path / "out", min_score=None, keep_fraction=0.5, threshold_sample=10000)
    manifest = json.loads((output / "manifest.json").read_text())
    cut, excluded = (
        manifest["models"]["quality_classifier"]["min_score"],
        excluded_records(output, "quality_classifier"),
    )
    scored = manifest["domains"]["general"]["documents"] + len(excluded)
    assert abs(len(excluded) / scored - 0.5) <= 1 / scored and all(r["score"] < cut for r in excluded)
    assert {f"spam-{i}" for i in range(40)} <= {r["id"] for r in excluded} | _dropped_before(output)
    with pytest.raises(ConfigError, match=r"prepare\.quality_classifier\.keep_fraction=0\.5: .* in place of min_score"):
        _prepare(planted, tmp_path / "both", keep_fraction=0.5, threshold_sample=10000)


def test_each_fold_trains_on_the_first_documents_outside_it_and_the_pool_is_read_no_further(monkeypatch):
    from glm46.data.scorers.fasttext_quality import fold_of
    from glm46.data.staged import classifier

    texts, read = [f"document {i}" for i in range(1000)], []

    def kept_texts(plan, domains, before):
        for text in texts:
            read.append(text)
            yield text

    monkeypatch.setattr(classifier, "kept_texts", kept_texts)
    pools = classifier._pools(None, ["general"], folds=3, limit=20)
    assert pools == [[t for t in texts if fold_of(t, 3) != fold][:20] for fold in range(3)]
    assert len(read) == max(texts.index(pool[-1]) for pool in pools) + 1  # stopped once every fold had its 20
    assert classifier._pools(None, ["general"], folds=1, limit=7) == [texts[:7]]


def test_training_is_the_same_whatever_floating_point_state_the_caller_left(tmp_path):
    """The classifier trains in an interpreter of its own: a rounding mode left set in this one (as a library or an
    earlier test may leave it) changes nothing. Trained in this process, the upward rounding gives another model."""
    import ctypes
    import hashlib

    libm, rng = ctypes.CDLL("libm.so.6"), random.Random(4)
    pool = [spam(rng) for _ in range(100)]
    digests = []
    for mode in (0, 0x800):  # FE_TONEAREST, FE_UPWARD (x86-64)
        libm.fesetround(mode)
        try:
            train_classifier(REFERENCE[:100], pool, tmp_path / f"{mode}.bin", SETTINGS["hyperparameters"], seed=0)
        finally:
            libm.fesetround(0)
        digests.append(hashlib.sha256((tmp_path / f"{mode}.bin").read_bytes()).hexdigest())
    assert digests[0] == digests[1]
