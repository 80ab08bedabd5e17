"""CCNet's perplexity filter (prepare.perplexity): the Kneser-Ney model is a distribution in every context, its ARPA
file reads back (and scores as kenlm does), word salad scores above the prose it was shuffled from, and the
preparation drops gibberish above prepare.perplexity.max while it keeps held-out prose, the same over 2 tasks as in
one process; a model file that cannot be read is refused naming the key."""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter

import numpy as np
import pytest

from bench.planted_docs import gibberish, paragraphs, salad
from glm46.data.scorers.ngram import BOS, NGramModel, arpa_counts, fit_kneser_ney, words
from glm46.errors import ConfigError

from .test_prepare_staged import assert_same_dataset, excluded_records, prepare_filtered, reference_and_pool

PERPLEXITY = {"order": 3, "domains": ["general"], "buckets": [0.33, 0.66], "bucket_sample": 10000}


PARAGRAPHS = paragraphs()
REFERENCE, HELD_OUT = PARAGRAPHS[:-120], PARAGRAPHS[-120:]


@pytest.fixture(scope="module")
def model() -> NGramModel:
    return fit_kneser_ney(REFERENCE, order=3)


def test_kneser_ney_gives_every_context_a_distribution(model, tmp_path):
    vocabulary = [gram[0] for gram in model.logprob if len(gram) == 1 and gram[0] != BOS]
    contexts = [(), (BOS,), (BOS, "the"), ("of", "the"), ("the", "zzz"), ("qqq", "zzz")]
    contexts += [gram for gram in list(model.backoff)[:20] if len(gram) == 2]
    for context in contexts:
        total = sum(10 ** model.log10_prob(context, word) for word in vocabulary)
        assert total == pytest.approx(1.0, abs=1e-9), context
    model.write_arpa(tmp_path / "model.arpa")
    orders = Counter(len(gram) for gram in model.logprob)
    assert arpa_counts(tmp_path / "model.arpa") == dict(orders) and set(orders) == {1, 2, 3}


def test_kenlm_scores_the_arpa_file_as_the_model_does(model, tmp_path):
    """KenLM (kenlm-ex's prebuilt wheel of it, a dev dependency) loads the written file and scores every sentence
    as the model does, to float32's rounding."""
    import kenlm

    model.write_arpa(tmp_path / "model.arpa")
    theirs = kenlm.Model(str(tmp_path / "model.arpa"))
    for text in HELD_OUT[:20] + [salad(HELD_OUT[0], random.Random(0)), "zzz qqq"]:
        for line in text.split("\n"):
            if tokens := words(line):
                assert theirs.score(" ".join(tokens)) == pytest.approx(model.sentence_log10(tokens), abs=1e-4)


def test_word_salad_scores_above_the_prose_it_was_shuffled_from(model):
    rng = random.Random(1)
    prose = np.array([model.perplexity(text) for text in HELD_OUT])
    shuffled = np.array([model.perplexity(salad(text, rng)) for text in HELD_OUT])
    letters = np.array([model.perplexity(gibberish(text, rng)) for text in HELD_OUT])
    assert (shuffled > prose).all() and np.median(shuffled / prose) > 2
    assert letters.min() > 4 * prose.max()


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Reference prose (domain docs) and a pool (general): held-out prose, its gibberish and its word salad."""
    rng, folder = random.Random(2), tmp_path_factory.mktemp("perplexity") / "in"
    folder.mkdir()
    pool = [{"text": text, "id": f"prose-{i}"} for i, text in enumerate(HELD_OUT[:60])]
    pool += [{"text": gibberish(text, rng), "id": f"gibberish-{i}"} for i, text in enumerate(HELD_OUT[60:80])]
    pool += [{"text": salad(text, rng), "id": f"salad-{i}"} for i, text in enumerate(HELD_OUT[:60])]
    rng.shuffle(pool)
    return reference_and_pool(folder, REFERENCE, pool)


def _prepare(source, output, tasks: int = 1, **settings):
    perplexity = PERPLEXITY | {"reference_domains": ["docs"], "max": 3000.0} | settings
    return prepare_filtered(source, output, tasks, perplexity=perplexity)


def test_the_stage_drops_gibberish_keeps_held_out_prose_and_scores_salad_above_its_source(planted, tmp_path):
    output = _prepare(planted, tmp_path / "one")
    manifest = json.loads((output / "manifest.json").read_text())
    excluded = excluded_records(output, "perplexity")
    assert {r["id"] for r in excluded} >= {f"gibberish-{i}" for i in range(20)}  # every one
    assert not any(r["id"].startswith("prose-") for r in excluded)
    assert manifest["dropped"]["perplexity"] == len(excluded) and all(r["score"] > 3000 for r in excluded)
    kept = [json.loads(line) for line in (output / "documents" / "general.jsonl").open()]
    score = {d["id"]: d["perplexity"] for d in kept} | {r["id"]: r["score"] for r in excluded}
    both = [i for i in range(60) if {f"prose-{i}", f"salad-{i}"} <= score.keys()]  # the others failed a rule
    assert len(both) > 50 and all(score[f"salad-{i}"] > score[f"prose-{i}"] for i in both)
    assert {d["perplexity_bucket"] for d in kept} == {"head", "middle", "tail"}
    assert not any("perplexity" in json.loads(line) for line in (output / "documents" / "docs.jsonl").open())
    fitted = manifest["models"]["perplexity"]
    assert fitted["documents"] == manifest["domains"]["docs"]["documents"]  # fitted on the kept reference
    assert len(fitted["sha256"]) == 64 and len(fitted["cutoffs"]) == 2
    assert_same_dataset(_prepare(planted, tmp_path / "two", tasks=2), output)


def test_a_given_arpa_model_scores_in_place_of_a_fitted_one(planted, model, tmp_path):
    model.write_arpa(tmp_path / "given.arpa")
    output = _prepare(planted, tmp_path / "out", model=str(tmp_path / "given.arpa"), reference_domains=[])
    manifest = json.loads((output / "manifest.json").read_text())
    given = manifest["models"]["perplexity"]
    assert given["sha256"] == hashlib.sha256((tmp_path / "given.arpa").read_bytes()).hexdigest()
    assert given["ngrams"] == len(model.logprob) and given["documents"] == 0
    excluded = excluded_records(output, "perplexity")
    assert {r["id"] for r in excluded} >= {f"gibberish-{i}" for i in range(20)}
    kept = [json.loads(line) for line in (output / "documents" / "general.jsonl").open()]
    prose = next(d for d in kept if d["id"] == "prose-0")  # scored by the given model, to KenLM's rounding
    assert prose["perplexity"] == pytest.approx(model.perplexity(prose["text"]), rel=1e-3)


def test_a_model_file_that_cannot_be_read_is_refused_naming_the_key(planted, tmp_path):
    bad = tmp_path / "model.arpa"
    bad.write_text("this is not an ARPA file\n")
    for path in (bad, tmp_path / "missing.arpa"):
        with pytest.raises(ConfigError, match=rf"prepare\.perplexity\.model={path}: cannot be read as an ARPA model"):
            _prepare(planted, tmp_path / "out", model=str(path), reference_domains=[])
    assert not (tmp_path / "out" / "manifest.json").exists()  # refused before a document was read
