"""The toxicity filter (prepare.toxicity): a long benign document with one offensive sentence is dropped (its
maximum, not its mean), benign technical text with violent verbs is kept, code is never scored; the same over 2
tasks as in one process; a threshold that is not a probability is refused naming the key."""

from __future__ import annotations

import json
import random

import pytest

from bench.planted_docs import OFFENSIVE, TECHNICAL
from glm46.data.pipeline import prepare_dataset
from glm46.data.scorers.toxic_sentences import max_toxicity
from glm46.errors import ConfigError

from .test_perplexity import HELD_OUT
from .test_prepare_staged import assert_same_dataset, excluded_records, prepare_filtered, write_parts


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Prose (general): benign paragraphs, long ones with one offensive sentence in the middle, and ones with the
    technical sentences; code (domain code) holding an offensive comment."""
    rng, folder = random.Random(0), tmp_path_factory.mktemp("toxicity") / "in"
    folder.mkdir()
    records = [{"text": text, "id": f"benign-{i}"} for i, text in enumerate(HELD_OUT[:40])]
    for i, text in enumerate(HELD_OUT[40:60]):
        middle = len(text) // 2
        records.append({"text": f"{text[:middle]}\n{OFFENSIVE[i % 2]}\n{text[middle:]}", "id": f"offensive-{i}"})
    for i, text in enumerate(HELD_OUT[60:80]):
        records.append({"text": f"{text}\n{TECHNICAL[i % 3]}", "id": f"technical-{i}"})
    code = 'def stop(child):\n    """{}"""\n    # {}\n    child.kill()\n'
    records += [
        {"text": code.format(doc, OFFENSIVE[0]), "id": f"code-{i}", "domain": "code"}
        for i, doc in enumerate(HELD_OUT[80:90])
    ]
    rng.shuffle(records)
    return write_parts(folder, [records[::2], records[1::2]])


def test_a_document_scores_its_most_offensive_sentence():
    long_benign = " ".join(HELD_OUT[:5])
    benign, with_one, technical = max_toxicity([long_benign, f"{long_benign}\n{OFFENSIVE[0]}", TECHNICAL[1]])
    assert with_one > 0.9 > max(benign, technical)


def _prepare(source, output, tasks: int = 1):
    return prepare_filtered(source, output, tasks, toxicity={"max": 0.9, "domains": ["general"]})


def test_offensive_sentences_are_found_in_long_documents_and_technical_text_is_kept(planted, tmp_path):
    output = _prepare(planted, tmp_path / "one")
    manifest = json.loads((output / "manifest.json").read_text())
    excluded = excluded_records(output, "toxicity")
    kept = {json.loads(line)["id"] for line in (output / "documents" / "general.jsonl").open()}
    assert not any(i.startswith("offensive-") for i in kept)
    assert all(r["id"].startswith("offensive-") and r["score"] > 0.9 for r in excluded)
    assert manifest["dropped"]["toxicity"] == len(excluded) >= 18  # the others failed a quality rule first
    assert {f"technical-{i}" for i in range(20)} <= kept
    assert manifest["domains"]["code"]["documents"] == 10  # code is not scored
    assert manifest["models"]["toxicity"]["package"] == "alt-profanity-check"
    assert_same_dataset(_prepare(planted, tmp_path / "two", tasks=2), output)


def test_a_threshold_that_is_not_a_probability_is_refused(planted, tmp_path):
    with pytest.raises(ConfigError, match=r"prepare\.toxicity\.max=1\.5: a probability"):
        prepare_dataset("jsonl", [str(planted)], tmp_path / "out", toxicity={"max": 1.5, "domains": ["general"]})
