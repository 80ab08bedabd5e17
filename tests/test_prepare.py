"""task=prepare: planted duplicates, near-duplicates, bad lines and low-quality documents give exact counts."""

import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasketch import LeanMinHash, MinHash, MinHashLSH

from glm46.data.dedup import dedup_near, minhash_signatures, shingles
from glm46.data.documents import Document, Ledger
from glm46.data.pipeline import prepare_dataset
from glm46.data.quality import QualityRules, violation
from glm46.data.sources import read_jsonl, read_parquet, read_text_folder

from . import forked

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 300  # a byte-level BPE's smallest useful vocabulary: these tests count documents, not tokens
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
    manifest = prepare_dataset("jsonl", [str(planted)], tmp_path / "out", dedup=DEDUP, vocab_size=VOCAB)
    assert manifest["documents_in"] == 50
    assert manifest["documents_out"] == 40
    assert manifest["dropped"] == {
        "exact_duplicate": 1,
        "url_duplicate": 1,
        "near_duplicate": 2,
        "malformed": 3,
        "empty": 1,
        "undecodable": 1,
        "quality/min_chars": 1,
    }
    assert manifest["documents_in"] == manifest["documents_out"] + sum(manifest["dropped"].values())
    assert manifest["bytes_in"] == (
        manifest["bytes_out"] + sum(manifest["bytes_dropped"].values()) + manifest["bytes_trimmed"]
    )
    assert [e.split(": ")[0] for e in manifest["examples"]["malformed"]] == [
        f"{planted / 'part1.jsonl'}:{line}" for line in (45, 46, 47)
    ]
    assert manifest["examples"]["undecodable"][0].startswith(str(planted / "part2.jsonl") + ":1")
    kept = [json.loads(line) for line in (tmp_path / "out" / "documents" / "general.jsonl").read_text().splitlines()]
    assert [d["id"] for d in kept] == [str(i) for i in range(40)], "the first of every group is the one kept"
    assert manifest["domains"] == {"general": {"documents": 40, "bytes": manifest["bytes_out"]}}


def test_stage_report_chains(planted, tmp_path):
    stages = prepare_dataset("jsonl", [str(planted)], tmp_path / "out", dedup=DEDUP, vocab_size=VOCAB)["stages"]
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


MASK64 = (1 << 64) - 1


def fmix64(h: int) -> int:
    h = (h ^ (h >> 33)) * 0xFF51AFD7ED558CCD & MASK64
    h = (h ^ (h >> 33)) * 0xC4CEB9FE1A85EC53 & MASK64
    return h ^ (h >> 33)


@functools.cache
def word_hash(word: bytes) -> int:
    return fmix64(sum(byte * pow(0x9E3779B97F4A7C15, t, 1 << 64) for t, byte in enumerate(word)) & MASK64)


def shingle_hash(shingle: bytes) -> int:
    """The documented shingle hash, one shingle at a time: Horner over fmix64(byte polynomial) of its words."""
    h = 0
    for word in shingle.split(b" ") if shingle else []:
        h = (h * 0xC2B2AE3D27D4EB4F + word_hash(word)) & MASK64
    return (h ^ (h >> 32)) & 0xFFFFFFFF


def random_docs(rng: random.Random, count: int, words: int = 120) -> list[str]:
    vocabulary = [f"word{i}" for i in range(3000)]
    return [" ".join(rng.choices(vocabulary, k=words)) for _ in range(count)]


def edited(rng: random.Random, text: str, changes: int) -> str:
    words = text.split()
    for position in rng.sample(range(len(words)), changes):
        words[position] = f"new{rng.randrange(10**6)}"
    return " ".join(words)


def test_signatures_are_datasketch_minhash_of_the_shingles():
    rng = random.Random(1)
    ascii_noise = ["".join(rng.choices("aB9_ -,.!?'\t\nZz()", k=rng.randrange(80))) for _ in range(30)]
    texts = [
        "Hello, World! hello world again and AGAIN, the end.",
        "a b c d e",
        "a b c d",
        "short",
        "",
        "!!! ...",
        "Héllo WÖRLD straße 数学 x_y İstanbul ÉCOLE, naïve café",
        "tabs\tand\nnew_lines 123 4.56 x-y",
        random_docs(rng, 1, words=20000)[0],
    ] + ascii_noise  # ... and one longer than a block of shingles
    signatures = minhash_signatures(texts, shingle_size=5, num_perm=64, seed=3)
    for text, row in zip(texts, signatures):
        reference = MinHash(num_perm=64, seed=3, hashfunc=shingle_hash)
        reference.update_batch(shingles(text, 5))
        assert np.array_equal(row, reference.hashvalues), text


def test_estimated_jaccard_agrees_with_exact_shingle_jaccard():
    rng = random.Random(2)
    pairs = [(doc, edited(rng, doc, changes)) for doc, changes in zip(random_docs(rng, 30, 200), range(0, 60, 2))]
    signatures = minhash_signatures([t for pair in pairs for t in pair], shingle_size=5, num_perm=128)
    errors = []
    for (a, b), sig_a, sig_b in zip(pairs, signatures[0::2], signatures[1::2]):
        exact = len(set(shingles(a, 5)) & set(shingles(b, 5))) / len(set(shingles(a, 5)) | set(shingles(b, 5)))
        estimate = LeanMinHash(seed=1, hashvalues=sig_a, scheme="affine32").jaccard(
            LeanMinHash(seed=1, hashvalues=sig_b, scheme="affine32")
        )
        errors.append(abs(estimate - exact))
    assert np.mean(errors) < 0.05 and max(errors) < 0.2, errors


def near_duplicate_corpus() -> tuple[list[str], set[int]]:
    """300 unrelated documents, then 20 of them with 2 words changed (Jaccard ~0.9: dropped), 20 with
    60 changed (kept) and 10 copied exactly (dropped)."""
    rng = random.Random(3)
    texts = random_docs(rng, 300, words=200)
    duplicates = set()
    for _ in range(20):
        duplicates.add(len(texts))
        texts.append(edited(rng, rng.choice(texts[:300]), 2))
        texts.append(edited(rng, rng.choice(texts[:300]), 60))
    for _ in range(10):
        duplicates.add(len(texts))
        texts.append(rng.choice(texts[:300]))
    return texts, duplicates


def test_planted_near_duplicates_are_dropped_and_unrelated_documents_kept():
    texts, duplicates = near_duplicate_corpus()
    ledger = Ledger()
    kept = dedup_near([Document(text=t, id=str(i)) for i, t in enumerate(texts)], ledger, num_workers=2)
    assert [int(d.id) for d in kept] == [i for i in range(len(texts)) if i not in duplicates]
    assert ledger.dropped == {"near_duplicate": len(duplicates)}


def test_dedup_near_equals_datasketch_lsh_loop_over_the_same_signatures():
    texts, _ = near_duplicate_corpus()
    texts += [texts[i] for i in range(0, 300, 7)]  # exact copies too: whole clusters of equal bands
    signatures = minhash_signatures(texts, shingle_size=5, num_perm=128)
    lsh, minhashes, expected = MinHashLSH(threshold=0.8, num_perm=128, weights=(0.2, 0.8)), {}, []
    for index, row in enumerate(signatures):
        minhash = LeanMinHash(seed=1, hashvalues=row, scheme="affine32")
        if not any(minhash.jaccard(minhashes[other]) >= 0.8 for other in lsh.query(minhash)):
            lsh.insert(index, minhash)
            minhashes[index] = minhash
            expected.append(index)
    kept = dedup_near([Document(text=t, id=str(i)) for i, t in enumerate(texts)], Ledger())
    assert [int(d.id) for d in kept] == expected


def test_signatures_are_deterministic_across_runs_chunks_and_workers(tmp_path):
    texts, _ = near_duplicate_corpus()
    signatures = minhash_signatures(texts, shingle_size=5, num_perm=128, seed=7)
    assert np.array_equal(minhash_signatures(texts, 5, 128, seed=7, num_workers=2, chunk=37), signatures)
    assert not np.array_equal(minhash_signatures(texts, 5, 128, seed=8), signatures)
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    script = (
        "import json, sys, numpy as np; from glm46.data.dedup import minhash_signatures; "
        "np.save(sys.argv[2], minhash_signatures(json.load(open(sys.argv[1])), 5, 128, seed=7))"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "texts.json"), str(tmp_path / "other.npy")],
        cwd=ROOT,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        check=True,
    )
    assert np.array_equal(np.load(tmp_path / "other.npy"), signatures)


def test_missing_input_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        list(read_jsonl([str(tmp_path / "does-not-exist")], Ledger()))


def test_run_py_prepare_command(planted, tmp_path):
    out = tmp_path / "dataset"
    result = forked.run(
        [
            sys.executable,
            "run.py",
            "task=prepare",
            "data=jsonl",  # the first spelling, still accepted: source=jsonl source.paths=... source.output_dir=...
            f"data.paths=[{planted}]",
            f"data.output_dir={out}",
            "prepare.tokenizer.vocab_size=300",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["documents_in"] == 50 and manifest["documents_out"] == 40
    assert "task=prepare" in manifest["command"]
    shards = json.loads((out / "tokens" / "shards.json").read_text())
    assert shards["vocab_size"] == 300 and shards["domains"]["general"]["documents"] == 40
    assert (out / "tokenizer.json").exists() and (out / "tokens" / "general.bin").stat().st_size > 0


def test_the_readers_former_data_spelling_is_rewritten_to_source():
    from glm46.config.aliases import renamed_overrides

    old = ["task=prepare", "data=jsonl", "data.paths=[a.jsonl]", "data.output_dir=out", "seed=1"]
    assert renamed_overrides(old) == [
        "task=prepare",
        "source=jsonl",
        "source.paths=[a.jsonl]",
        "source.output_dir=out",
        "seed=1",
    ]
    training = ["data=shards", "data.path=/d", "data.batch_size=4"]  # a DataModule: not renamed, trained in one stage
    assert renamed_overrides(training) == ["experiment=own_pretrain", *training]
    # the design's name of the quality classifier's cut (prepare.quality is the Gopher rules' node)
    assert renamed_overrides(["prepare.quality.min_score=0.5", "++prepare.quality.min_score=0.4"]) == [
        "prepare.quality_classifier.min_score=0.5",
        "++prepare.quality_classifier.min_score=0.4",
    ]


def test_a_filters_cut_alone_fits_its_model_on_the_sources_reference_domains(compose_config):
    """The design's keys turn the model-based filters on by themselves: a perplexity `max` or a classifier cut with no
    reference of its own fits on the source's reference domains (the embedded corpus's documentation); unset, off."""
    from omegaconf import OmegaConf

    from glm46.config.aliases import renamed_overrides
    from glm46.data.cache import filter_on

    def prepare(*overrides):
        cfg = compose_config(*renamed_overrides(["task=prepare", "source=embedded", *overrides]))
        return OmegaConf.to_container(cfg.prepare, resolve=True)

    off, on = prepare(), prepare("prepare.perplexity.max=3000", "prepare.quality.min_score=0.5")
    for name in ("perplexity", "quality_classifier"):
        assert (
            not filter_on(name, off[name]) and filter_on(name, on[name]) and on[name]["reference_domains"] == ["docs"]
        )
    given = prepare("prepare.perplexity.max=3000", "prepare.perplexity.reference_domains=[license]")
    assert given["perplexity"]["reference_domains"] == ["license"]
