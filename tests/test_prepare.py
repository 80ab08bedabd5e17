"""task=prepare: planted duplicates, near-duplicates, bad lines and low-quality documents give exact counts."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from glm46.data.documents import Document, Ledger
from glm46.data.prepare import prepare
from glm46.data.quality import QualityRules, violation
from glm46.data.sources import read_jsonl, read_parquet, read_text_folder

ROOT = Path(__file__).resolve().parents[1]
DEDUP = {"exact": True, "url": True, "near": True, "threshold": 0.8, "num_perm": 128, "shingle_size": 5, "seed": 1}


def prose(rng: random.Random, words: int = 150) -> str:
    vocabulary = [f"{a}{b}" for a in ("lor", "ips", "dol", "sit", "amet", "cons", "adip", "elit") for b in "aeiou"]
    return " ".join(rng.choice(vocabulary) for _ in range(words)) + "."


@pytest.fixture
def planted(tmp_path):
    """50 inputs: 40 distinct documents, then 1 exact duplicate, 1 URL duplicate, 2 near-duplicates,
    2 malformed lines, 1 record without text, 1 empty text, 1 too-short document, 1 undecodable line."""
    rng = random.Random(0)
    docs = [prose(rng) for _ in range(40)]
    lines = [json.dumps({"text": d, "id": i, "url": f"https://example.org/{i}"}) for i, d in enumerate(docs)]
    near = docs[2].split()
    near[10], near[20] = "changed", "words"
    lines += [
        json.dumps({"text": docs[0]}),  # exact duplicate
        json.dumps({"text": prose(rng), "url": "HTTPS://Example.org/1/"}),  # same URL as document 1
        json.dumps({"text": " ".join(near)}),  # near-duplicate of document 2
        json.dumps({"text": docs[3] + " And one more sentence."}),  # near-duplicate of document 3
        "{broken json",
        "[1, 2, 3]",
        json.dumps({"body": "no text field"}),
        json.dumps({"text": "  \n\t "}),
        json.dumps({"text": "too short"}),
        "",  # a blank line is not a document
    ]
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "part1.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "part2.jsonl").write_bytes(b'{"text": "caf\xe9 latin-1 bytes"}\n')
    return folder


def test_planted_folder_gives_the_expected_counts(planted, tmp_path):
    ledger = Ledger()
    manifest = prepare(read_jsonl([str(planted)], ledger), ledger, tmp_path / "out", DEDUP, QualityRules())
    assert manifest["documents_in"] == 50
    assert manifest["documents_out"] == 40
    assert manifest["dropped"] == {"exact_duplicate": 1, "url_duplicate": 1, "near_duplicate": 2, "malformed": 3,
                                   "empty": 1, "undecodable": 1, "quality/min_chars": 1}
    assert manifest["documents_in"] == manifest["documents_out"] + sum(manifest["dropped"].values())
    assert manifest["bytes_in"] == (manifest["bytes_out"] + sum(manifest["bytes_dropped"].values())
                                    + manifest["bytes_trimmed"])
    assert [e.split(": ")[0] for e in manifest["examples"]["malformed"]] == [
        f"{planted / 'part1.jsonl'}:{line}" for line in (45, 46, 47)]
    assert manifest["examples"]["undecodable"][0].startswith(str(planted / "part2.jsonl") + ":1")
    kept = [json.loads(line) for line in (tmp_path / "out" / "documents" / "general.jsonl").read_text().splitlines()]
    assert [d["id"] for d in kept] == [str(i) for i in range(40)], "the first of every group is the one kept"
    assert manifest["domains"] == {"general": {"documents": 40, "bytes": manifest["bytes_out"]}}


def test_stage_report_chains(planted, tmp_path):
    ledger = Ledger()
    stages = prepare(read_jsonl([str(planted)], ledger), ledger, tmp_path / "out", DEDUP, QualityRules())["stages"]
    for before, after in zip(stages, stages[1:]):
        assert after["documents_in"] == before["documents_out"]
        assert after["documents_out"] == after["documents_in"] - sum(after["dropped"].values())


@pytest.mark.parametrize(
    "text, domain, rule",
    [
        ("x" * 10, "general", "min_chars"),
        ("same line here\n" * 10 + "other", "code", "max_duplicate_line_fraction"),
        ("ab cd " * 60, "code", "max_top_bigram_fraction"),
        ("short words only here " * 1 + "and a few more", "general", "min_words"),
        (" ".join(a + b for a in "abcde" for b in "fghijklm"), "general", "min_mean_word_length"),
        (" ".join(f"extraordinarily{i}long{i}words" for i in range(30)), "general", "max_mean_word_length"),
        (" ".join(f"#{i} heading{i} words{i}" for i in range(30)), "general", "max_symbol_word_ratio"),
        (" ".join(f"{i:08d} n{i}" for i in range(40)), "general", "max_digit_fraction"),
    ],
)
def test_each_quality_rule_fires(text, domain, rule):
    assert violation(Document(text=text, domain=domain), QualityRules()) == rule


def test_code_is_exempt_from_prose_rules():
    code = "\n".join(f"def f{i}(x):  # {i}\n    return x[{i}] * {i}" for i in range(20))
    assert violation(Document(text=code, domain="code"), QualityRules()) is None
    assert violation(Document(text=code, domain="general"), QualityRules()) is not None


def test_text_folders_and_parquet_are_read_with_problems_counted(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.md").write_bytes(b"\xff\xfe not utf-8")
    ledger = Ledger()
    assert [d.text for d in read_text_folder([str(tmp_path)], ledger)] == ["hello world"]
    assert ledger.dropped == {"undecodable": 1}

    table = pa.table({"text": ["one", None, "three"], "url": ["u1", None, None], "domain": ["code", None, "math"]})
    pq.write_table(table, tmp_path / "data.parquet")
    ledger = Ledger()
    docs = list(read_parquet([str(tmp_path / "data.parquet")], ledger))
    assert [(d.text, d.domain, d.url) for d in docs] == [("one", "code", "u1"), ("three", "math", None)]
    assert ledger.dropped == {"malformed": 1} and ledger.documents_in == 3


def test_missing_input_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        list(read_jsonl([str(tmp_path / "does-not-exist")], Ledger()))


def test_run_py_prepare_command(planted, tmp_path):
    out = tmp_path / "dataset"
    result = subprocess.run(
        [sys.executable, "run.py", "task=prepare", "data=jsonl", f"data.paths=[{planted}]", f"data.output_dir={out}",
         "prepare.tokenizer.vocab_size=300", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["documents_in"] == 50 and manifest["documents_out"] == 40
    assert "task=prepare" in manifest["command"]
    shards = json.loads((out / "tokens" / "shards.json").read_text())
    assert shards["vocab_size"] == 300 and shards["domains"]["general"]["documents"] == 40
    assert (out / "tokenizer.json").exists() and (out / "tokens" / "general.bin").stat().st_size > 0
