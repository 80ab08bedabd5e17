"""task=prepare over several tasks (glm46.data.staged) equals the one-process preparation: the same documents
kept, the same drops per reason, the same tokens and fingerprint, for 1, 2 and 4 tasks, here and on Slurm; a task
that died is rerun alone; what cannot run is refused before anything starts."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from glm46.data.cache import prepare_fingerprint
from glm46.data.pipeline import prepare_dataset
from glm46.data.quality import QualityRules
from glm46.data.scorers.fasttext_quality import train_classifier
from glm46.data.staged.executors import StageFailedError, run_local, verdict_in
from glm46.data.staged.stages import run_task
from glm46.data.staged.work import WORK, StagedPlan, make_plan
from glm46.errors import ConfigError

from . import forked
from .slurm import require_slurm, usable_nodes

ROOT = Path(__file__).resolve().parents[1]
DEDUP = {"exact": True, "url": True, "near": True, "threshold": 0.8, "num_perm": 128, "shingle_size": 5, "seed": 1}
VOCAB = 600
PER_FILE_KEYS = ("documents_in", "documents_out", "dropped", "bytes_in", "bytes_out", "bytes_dropped")
MANIFEST_KEYS = PER_FILE_KEYS + ("bytes_trimmed", "files", "empty_files", "domains", "stages", "examples", "excluded")


def _prose(rng: random.Random, words: int) -> str:
    vocabulary = [f"{a}{b}{c}" for a in ("lor", "ips", "dol", "sit", "amet", "cons") for b in "aeiou" for c in "nrst"]
    return " ".join(rng.choice(vocabulary) for _ in range(words)) + "."


def corpus_records(seed: int = 0, files: int = 4, per_file: int = 60) -> list[list[object]]:
    """Per file, its records: distinct prose and code, then duplicates planted across files (exact, URL, near
    within and across files, chains of near-duplicates), low-quality, empty and malformed inputs."""
    rng = random.Random(seed)
    originals = [[_prose(rng, rng.randint(40, 200)) for _ in range(per_file)] for _ in range(files)]
    records = []
    for f, texts in enumerate(originals):
        rows: list[object] = [
            {"text": t, "url": f"https://example.org/{f}/{i}", "domain": "code" if i % 5 == 0 else None}
            for i, t in enumerate(texts)
        ]
        other = originals[(f + 1) % files]
        near = other[3].split()
        near[5], near[15] = "changed", "words"
        chain = originals[(f + 2) % files][7].split()
        rows += [
            {"text": originals[(f + 3) % files][1]},  # exact duplicate of another file's document
            {"text": "  " + other[2] + "\r\n"},  # the same after normalisation
            {"text": _prose(rng, 80), "url": f"HTTPS://EXAMPLE.org/{(f + 1) % files}/4/"},  # another file's URL
            {"text": " ".join(near)},  # near-duplicate across files
            {"text": " ".join(chain[:-3])},  # near-duplicates of a near-duplicate: which stays depends on order
            {"text": " ".join(chain[2:])},
            {"text": f"short text {f}"},  # quality/min_chars
            {"text": f"word{f} " * 60},  # repeated bigrams
            {"text": "café " + _prose(rng, 30)},
            {"text": " \n "},  # empty
            "{not json",  # malformed
            [1, 2],
        ]
        rng.shuffle(rows)
        records.append(rows)
    return records


def write_jsonl(records: list[list[object]], folder: Path) -> Path:
    folder.mkdir(parents=True)
    for f, rows in enumerate(records):
        lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
        (folder / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def one_process(source: Path, output: Path, reader: str = "jsonl", tokenizer: str | None = None, **filters) -> Path:
    prepare_dataset(
        reader,
        [str(source)],
        output,
        dedup=DEDUP,
        quality=QualityRules(),
        tokenizer_path=tokenizer,
        vocab_size=VOCAB,
        keep_excluded=True,
        **filters,
    )
    return output


def staged(source: Path, output: Path, tasks: int, workers: int = 1, reader: str = "jsonl", tokenizer=None, **filters):
    """The staged preparation over `tasks` tasks; `filters`: perplexity=..., toxicity=... (prepare's nodes)."""
    plan = make_plan(*_nodes(source, output, tasks, reader, tokenizer, **filters), threads=1)
    plan.save()
    run_local(plan, workers)
    return output


def prepare_filtered(source: Path, output: Path, tasks: int = 1, **filters) -> Path:
    """`source`'s JSONL prepared with `filters` (perplexity=..., toxicity=...: prepare's nodes) and the excluded
    files kept: in this process (one task) or over `tasks` staged tasks."""
    if tasks > 1:
        return staged(source, output, tasks, **filters)
    prepare_dataset("jsonl", [str(source)], output, dedup=DEDUP, vocab_size=VOCAB, keep_excluded=True, **filters)
    return output


def write_parts(folder: Path, parts: list[list[dict]]) -> Path:
    """Each part's records as part-<i>.jsonl in `folder`."""
    for part, records in enumerate(parts):
        (folder / f"part-{part}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def reference_and_pool(folder: Path, reference: list[str], pool: list[dict]) -> Path:
    """The reference texts (domain docs) and the pool's records, each dealt alternately over two files."""
    records = [{"text": text, "domain": "docs"} for text in reference]
    return write_parts(folder, [records[::2] + pool[::2], records[1::2] + pool[1::2]])


def excluded_records(output: Path, reason: str) -> list[dict]:
    """The lines of a preparation's excluded/<reason>.jsonl."""
    return [json.loads(line) for line in (output / "excluded" / f"{reason}.jsonl").open()]


def _nodes(source: Path, output: Path, tasks: int, reader: str = "jsonl", tokenizer: str | None = None, **filters):
    source_node = {"reader": reader, "paths": [str(source)], "output_dir": str(output), "default_domain": "general"}
    settings = {
        "tasks": tasks,
        "dedup": DEDUP,
        "quality": vars(QualityRules()),
        "tokenizer": {"path": tokenizer, "vocab_size": VOCAB, "max_digits": 3},
        "keep_excluded": True,
        **filters,
    }
    return source_node, settings, prepare_fingerprint(source_node, settings)


def assert_same_dataset(staged_dir: Path, reference: Path) -> None:
    """Every file the one-process preparation writes, equal byte for byte (the manifest in its counts)."""
    ours, theirs = (json.loads((d / "manifest.json").read_text()) for d in (staged_dir, reference))
    for key in MANIFEST_KEYS:
        assert ours[key] == theirs[key], key
    names = sorted(p.relative_to(reference).as_posix() for p in reference.rglob("*") if p.is_file())
    names = [n for n in names if n not in ("manifest.json", "prepared.json")]
    assert names == sorted(
        p.relative_to(staged_dir).as_posix()
        for p in staged_dir.rglob("*")
        if p.is_file() and WORK not in p.parts and p.name not in ("manifest.json", "prepared.json")
    )
    for name in names:
        assert (staged_dir / name).read_bytes() == (reference / name).read_bytes(), name


@pytest.fixture(scope="module")
def jsonl_corpus(tmp_path_factory):
    folder = write_jsonl(corpus_records(), tmp_path_factory.mktemp("corpus") / "in")
    return folder, one_process(folder, tmp_path_factory.mktemp("one") / "out")


def test_the_planted_corpus_exercises_every_reason(jsonl_corpus):
    """The comparison below means something: every stage drops documents, some across files."""
    manifest = json.loads((jsonl_corpus[1] / "manifest.json").read_text())
    assert manifest["documents_in"] == 4 * 72
    for reason in ("exact_duplicate", "url_duplicate", "near_duplicate", "empty", "malformed", "quality/min_chars"):
        assert manifest["dropped"].get(reason, 0) >= 4, reason
    assert set(manifest["domains"]) == {"code", "general"}


def test_each_dropped_input_is_kept_with_its_reason_source_and_text(jsonl_corpus):
    """prepare.keep_excluded: a line per dropped input, counted as the manifest counts its drops, each pointing at
    the input line it came from (the staged runs below compare these files with the one process's too)."""
    folder, output = jsonl_corpus
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["excluded"] == manifest["dropped"]
    inputs = {f"{f}:{n}": line for f in sorted(folder.glob("*.jsonl")) for n, line in enumerate(f.open(), 1)}
    for reason in manifest["dropped"]:
        records = [json.loads(line) for line in (output / "excluded" / f"{reason}.jsonl").open()]
        assert {r["reason"] for r in records} == {reason} and len(records) == manifest["dropped"][reason]
        for record in records:
            line = inputs[record["source"]]
            if reason == "malformed":
                assert record["text"] is None and record["detail"]
            elif reason != "empty":  # normalised: an empty one is trimmed to ""
                assert record["text"].split() == json.loads(line)["text"].split(), (reason, record)
    near = [json.loads(line)["text"].split() for line in (output / "excluded" / "near_duplicate.jsonl").open()]
    assert any(words[5] == "changed" and words[15] == "words" for words in near)  # a planted edit


@pytest.mark.parametrize(("tasks", "workers"), [(1, 1), (2, 1), (4, 1), (4, 2)])
def test_staged_preparation_equals_one_process(jsonl_corpus, tmp_path, tasks, workers):
    folder, reference = jsonl_corpus
    output = staged(folder, tmp_path / "out", tasks, workers)
    assert_same_dataset(output, reference)
    plan = StagedPlan.load(output)
    assert [len(files) for files in plan.shards] == [4 // tasks] * tasks
    assert not list((output / WORK).glob("read/*/meta.npz")), "the bulky work files are removed after the merge"


def test_with_a_given_tokenizer_the_token_fingerprint_is_the_same(jsonl_corpus, tmp_path):
    folder, reference = jsonl_corpus
    tokenizer = str(reference / "tokenizer.json")
    expected = one_process(folder, tmp_path / "one", tokenizer=tokenizer)
    output = staged(folder, tmp_path / "staged", 3, tokenizer=tokenizer)
    assert_same_dataset(output, expected)
    shards = json.loads((output / "tokens" / "shards.json").read_text())
    assert shards["fingerprint"] == json.loads((reference / "tokens" / "shards.json").read_text())["fingerprint"]


def test_merge_tasks_hash_their_own_pieces_of_the_fingerprint(jsonl_corpus, tmp_path, monkeypatch):
    """The token fingerprint hashes pieces of CHUNK_TOKENS: with small pieces, each merge task hashes those within
    its part and the finish reads back only those that straddle two parts; the fingerprint is one process's."""
    import glm46.data.shards
    import glm46.data.staged.assemble

    for module in (glm46.data.shards, glm46.data.staged.assemble):
        monkeypatch.setattr(module, "CHUNK_TOKENS", 1000)
    folder, reference = jsonl_corpus
    tokenizer = str(reference / "tokenizer.json")
    expected = one_process(folder, tmp_path / "one", tokenizer=tokenizer)
    output = staged(folder, tmp_path / "staged", 4, tokenizer=tokenizer)
    assert_same_dataset(output, expected)
    plan, shards = StagedPlan.load(output), json.loads((output / "tokens" / "shards.json").read_text())
    pieces = sum(-(-domain["tokens"] // 1000) for domain in shards["domains"].values())
    hashed = sum(len(d) for i in range(4) for d in plan.stats("merge", i)["digests"].values())
    read_back = plan.stats("finish", 0)["pieces_read_back"]
    assert hashed + read_back == pieces and 0 < read_back <= 2 * 3  # at most one per domain and task boundary
    assert shards["fingerprint"] != json.loads((reference / "tokens" / "shards.json").read_text())["fingerprint"]


def test_the_embedded_corpus_split_into_slices_equals_one_process(tmp_path):
    options = {"math_problems": 300, "reasoning_problems": 200, "sft_conversations": 100, "rl_prompts": 300, "seed": 0}
    reference = tmp_path / "one"
    prepare_dataset("embedded", [], reference, options=options, dedup=DEDUP, vocab_size=VOCAB, keep_excluded=True)
    source = {"reader": "embedded", "paths": [], "output_dir": str(tmp_path / "staged"), "options": options}
    settings = {
        "tasks": 3,
        "dedup": DEDUP,
        "quality": vars(QualityRules()),
        "tokenizer": {"path": None, "vocab_size": VOCAB, "max_digits": 3},
        "keep_excluded": True,
    }
    plan = make_plan(source, settings, prepare_fingerprint(source, settings))
    plan.save()
    run_local(plan, 1)
    assert_same_dataset(tmp_path / "staged", reference)


def _parquet_corpus(folder: Path, records: list[list[object]]) -> list[Path]:
    folder.mkdir(parents=True)
    files = []
    for f, rows in enumerate(records):
        table = pa.table({"text": [r["text"] for r in rows if isinstance(r, dict)]})
        pq.write_table(table, folder / f"part-{f}.parquet")
        files.append(folder / f"part-{f}.parquet")
    return files


def _break_footer(file: Path) -> bytes:
    """Overwrite the footer's magic bytes (same size, same mtime: the same fingerprint); return the original."""
    original, stat = file.read_bytes(), file.stat()
    file.write_bytes(original[:-4] + b"XXXX")
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    return original


def _restore(file: Path, original: bytes) -> None:
    stat = file.stat()
    file.write_bytes(original)
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_setting_refused_inside_a_slurm_task_reaches_the_user_as_itself(tmp_path):
    """submitit hands back a failed job's traceback as the text of a FailedJobError: the ConfigError in it (the last
    exception, its message on several lines) is raised as itself, not as a task to rerun; anything else is not."""
    import submitit

    message = "prepare.quality_classifier.domains=['web']: no document left\nto train on"
    executor = submitit.LocalExecutor(tmp_path)  # a real submitit job, its own process, as on Slurm
    executor.update_parameters(timeout_min=5)
    job = executor.submit(exec, f"from glm46.errors import ConfigError\nraise ConfigError({message!r})")
    with pytest.raises(submitit.core.utils.FailedJobError) as failed:
        job.result()
    verdict = verdict_in(str(failed.value))
    assert type(verdict) is ConfigError and str(verdict) == message
    assert verdict_in("Traceback (most recent call last):\nValueError: bad footer") is None


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failed_task_is_rerun_alone_and_the_result_is_the_same(tmp_path, workers):
    """In this process (workers 1) and as processes of their own (workers 2: the error is the task log's last line)."""
    files = _parquet_corpus(tmp_path / "in", corpus_records(seed=1, files=3))
    reference = one_process(tmp_path / "in", tmp_path / "one", reader="parquet")
    original = _break_footer(files[2])
    plan = make_plan(*_nodes(tmp_path / "in", tmp_path / "out", 3, "parquet"))
    plan.save()
    with pytest.raises(StageFailedError, match=r"stage read task 3/3 failed: ValueError: .*part-2.parquet"):
        run_local(plan, workers)
    finished = {i: (plan.task_dir("read", i) / "stats.json").stat().st_mtime_ns for i in (0, 1)}
    assert plan.pending("read") == [2]
    (plan.work / "read" / "2.partial-1").mkdir()  # what a task killed mid-write leaves
    _restore(files[2], original)
    run_local(make_plan(*_nodes(tmp_path / "in", tmp_path / "out", 3, "parquet")), workers)
    assert {i: (plan.task_dir("read", i) / "stats.json").stat().st_mtime_ns for i in (0, 1)} == finished
    assert_same_dataset(tmp_path / "out", reference)


def test_a_finished_task_is_not_run_again(jsonl_corpus, tmp_path):
    plan = make_plan(*_nodes(jsonl_corpus[0], tmp_path / "out", 2))
    plan.save()
    first = run_task(plan.output_dir, "read", 1)
    assert run_task(plan.output_dir, "read", 1) == first
    assert plan.pending("read") == [0]


def test_what_cannot_run_is_refused_before_anything_starts(jsonl_corpus, tmp_path):
    folder = jsonl_corpus[0]
    with pytest.raises(ConfigError, match=r"prepare.tasks=5: source.paths holds 4 input file\(s\)"):
        make_plan(*_nodes(folder, tmp_path / "a", 5))
    with pytest.raises(ConfigError, match=r"source.paths: .*/nothing-\*.jsonl matches nothing"):
        make_plan(*_nodes(folder.parent / "nothing-*.jsonl", tmp_path / "a", 2))
    staged(folder, tmp_path / "b", 2)
    other = _nodes(folder, tmp_path / "b", 2)
    other[1]["dedup"] = DEDUP | {"threshold": 0.7}
    with pytest.raises(ConfigError, match=r"source.output_dir=.*/b holds another preparation"):
        make_plan(other[0], other[1], prepare_fingerprint(other[0], other[1]))
    make_plan(*_nodes(folder, tmp_path / "c", 2)).save()
    with pytest.raises(ConfigError, match=r"holds the unfinished work of another staged preparation .*2 tasks"):
        make_plan(*_nodes(folder, tmp_path / "c", 4))
    assert not (tmp_path / "a").exists()


def test_a_glob_of_input_files_is_read_as_its_matches(jsonl_corpus, tmp_path):
    folder, reference = jsonl_corpus
    output = staged(Path(f"{folder}/part-*.jsonl"), tmp_path / "out", 2)
    assert_same_dataset(output, reference)


def _run_py(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    return forked.run(
        [sys.executable, str(ROOT / "run.py"), *overrides],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
        check=False,
    )


def test_run_py_prepares_over_tasks_here_and_refuses_bad_counts(jsonl_corpus, tmp_path):
    folder, reference = jsonl_corpus
    common = ["task=prepare", "source=jsonl", f"source.paths=[{folder}]", f"prepare.tokenizer.vocab_size={VOCAB}"]
    output = [f"source.output_dir={tmp_path / 'out'}", "prepare.tasks=2", "prepare.keep_excluded=true"]
    done = _run_py(*common, *output, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_dataset(tmp_path / "out", reference)
    assert re.search(r"every stage done\n.*\nread +2/2 +280 ", done.stdout), done.stdout
    refused = _run_py(*common, f"source.output_dir={tmp_path / 'x'}", "prepare.tasks=0", cwd=tmp_path)
    assert (
        refused.returncode != 0 and "prepare.tasks=0: the number of tasks of each stage is at least 1" in refused.stderr
    )


def test_a_dry_run_prints_the_estimate_and_what_each_task_reads_and_writes_nothing(jsonl_corpus, tmp_path):
    folder = jsonl_corpus[0]
    common = ["task=prepare", "source=jsonl", f"source.paths=[{folder}]", f"source.output_dir={tmp_path / 'out'}"]
    overrides = ["prepare.tasks=2", "prepare.dry=true", "prepare.estimate.corpus_tokens=23e12"]
    result = _run_py(*common, *overrides, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # 23e12 tokens x 6.1e-7 task-seconds per token over 2 tasks, plus 2.3e10 documents x 1e-7 s in clusters
    assert "time       1,949.25 h, of which 0.64 h in the one-task stages" in result.stdout, result.stdout
    assert f"read task 2: 2 file(s), {folder}/part-2.jsonl ... {folder}/part-3.jsonl" in result.stdout
    assert not (tmp_path / "out").exists()
    semantic = _run_py(*common, *overrides, "prepare.semantic_dedup.threshold=0.9", cwd=tmp_path)
    # 2.3e10 documents x 0.05 s over 2 tasks, and the 10,000 of the k-means sample in one task
    assert ", 159,722.36 h in the model-based filters" in semantic.stdout, semantic.stdout


@pytest.mark.slurm
def test_on_slurm_the_stages_run_as_dependent_arrays_and_a_failed_task_resumes(tmp_path):
    require_slurm()
    files = _parquet_corpus(tmp_path / "in", corpus_records(seed=2, files=2))
    # with every model-based filter on: the pool's own n-gram model (its tail above 37.5 dropped), a fastText
    # classifier told apart a few documents of each file (about half the others below 0.5), toxicity, semantic dedup
    perplexity = {"reference_domains": ["general"], "model": None, "order": 3, "domains": ["general"], "max": 37.5}
    perplexity |= {"buckets": [0.33, 0.66], "bucket_sample": 10000}
    texts = [[row["text"] for row in rows[:30] if isinstance(row, dict)] for rows in corpus_records(seed=2, files=2)]
    fasttext = {"lr": 1.0, "dim": 100, "ws": 5, "epoch": 10, "minCount": 1, "wordNgrams": 2, "bucket": 100000}
    train_classifier(texts[0], texts[1], tmp_path / "classifier.bin", fasttext, seed=0)
    filters = {
        "perplexity": perplexity,
        "quality_classifier": {"reference_domains": [], "model": str(tmp_path / "classifier.bin"), "min_score": 0.5}
        | {"domains": ["general"], "folds": 2, "max_documents": 1000, "seed": 0, "hyperparameters": fasttext},
        "toxicity": {"max": 0.9, "domains": ["general"]},
        "semantic_dedup": {"threshold": 0.9, "domains": ["general"], "clusters": 2, "fit_sample": 10000}
        | {"max_tokens": 64, "seed": 0},
    }
    reference = one_process(tmp_path / "in", tmp_path / "one", "parquet", **filters)
    dropped = json.loads((tmp_path / "one" / "manifest.json").read_text())["dropped"]
    assert all(dropped[reason] > 0 for reason in ("perplexity", "quality_classifier", "semantic_duplicate"))
    original = _break_footer(files[1])
    command = [
        "task=prepare",
        "source=parquet",
        f"source.paths=[{tmp_path / 'in'}]",
        f"source.output_dir={tmp_path / 'out'}",
        "prepare.tasks=2",
        f"prepare.tokenizer.vocab_size={VOCAB}",
        "prepare.keep_excluded=true",
        "prepare.perplexity.reference_domains=[general]",
        "prepare.perplexity.domains=[general]",
        "prepare.perplexity.max=37.5",
        "prepare.toxicity.max=0.9",
        "prepare.toxicity.domains=[general]",
        f"prepare.quality_classifier.model={tmp_path / 'classifier.bin'}",
        "prepare.quality_classifier.domains=[general]",
        "prepare.quality_classifier.min_score=0.5",
        "prepare.semantic_dedup.threshold=0.9",
        "prepare.semantic_dedup.domains=[general]",
        "prepare.semantic_dedup.clusters=2",
        "prepare.semantic_dedup.max_tokens=64",
        "cluster=local_slurm",
        f"paths.sweep_dir={tmp_path / 'sweeps'}",
        "hydra.launcher.wait=true",
    ]
    failed = _run_py(*command, cwd=tmp_path)
    assert failed.returncode != 0
    assert "stage read task 2/2 failed" in failed.stderr + failed.stdout, (failed.stdout + failed.stderr)[-3000:]
    plan = StagedPlan.load(tmp_path / "out")
    assert plan.pending("read") == [1] and plan.pending("exact") == [0, 1]
    _restore(files[1], original)
    resumed = _run_py(*command, cwd=tmp_path)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert re.search(r"read +\d+ \(1 task\(s\)\)", resumed.stdout), resumed.stdout
    assert_same_dataset(tmp_path / "out", reference)
    progress = forked.run(
        [sys.executable, "-m", "glm46.data.staged", str(tmp_path / "out")], capture_output=True, text=True, check=True
    )
    assert re.search(r"merge +2/2", progress.stdout) and re.search(r"finish +1/1", progress.stdout), progress.stdout
    if usable_nodes() >= 2:  # the multi-node cluster (CI's): the arrays' tasks ran on several hosts
        accounted = subprocess.run(
            ["sacct", "-X", "-n", "-P", "-S", "now-1hour", "-o", "NodeList,WorkDir"], capture_output=True, text=True
        ).stdout.splitlines()
        hosts = {line.split("|")[0] for line in accounted if line.endswith(f"|{tmp_path}")}
        assert len(hosts) >= 2, accounted
