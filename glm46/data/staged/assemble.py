"""The last stages of a staged preparation: `merge` writes each reader's tokens into the shards at their offsets,
and `finish` writes the manifest and the preparation's report from every stage's ledger (see glm46.data.staged.stages
for the stages before them)."""

from __future__ import annotations

import io
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np

from ..cache import mark_prepared
from ..documents import Ledger
from ..prepare import (
    EmptyDatasetError,
    build_manifest,
    empty_dataset_message,
    stage_entry,
)
from ..scorers.sentence_embeddings import encoder_record
from ..scorers.toxic_sentences import classifier as toxicity_classifier
from ..shards import CHUNK_TOKENS, chunk_digest, shards_fingerprint, token_dtype, write_index
from ..tokenizer import GLMTokenizer
from .excluded import join_excluded
from .work import DEDUP_REASONS, DROP_REASONS, FILTER_REASONS, StagedPlan


def _merged_ledger(plan: StagedPlan) -> Ledger:
    """The one-process ledger: the read tasks' ledgers summed, then the tokenize tasks' drops, examples in order."""
    ledger = Ledger()
    for reader in range(plan.tasks):
        state = plan.stats("read", reader)["ledger"]
        ledger.documents_in += state["documents_in"]
        ledger.bytes_in += state["bytes_in"]
        ledger.trimmed_bytes += state["trimmed_bytes"]
        ledger.files += state["files"]
        ledger.empty_files += state["empty_files"]
        ledger.dropped.update(state["dropped"])
        ledger.dropped_bytes.update(state["dropped_bytes"])
        for reason, examples in state["examples"].items():
            ledger.examples.setdefault(reason, []).extend(examples)
    for reader in range(plan.tasks):
        for reason, drop in plan.stats("tokenize", reader)["dropped"].items():
            ledger.dropped[reason] += drop["count"]
            ledger.dropped_bytes[reason] += drop["bytes"]
            ledger.examples.setdefault(reason, []).extend(drop["examples"])
    ledger.empty_files = ledger.empty_files[: Ledger.max_examples]
    ledger.examples = {reason: examples[: Ledger.max_examples] for reason, examples in ledger.examples.items()}
    return ledger


def _stage_report(plan: StagedPlan, ledger: Ledger) -> list[dict]:
    """The manifest's `stages`, as one process writes them, from the merged counts."""
    reads = [plan.stats("read", reader) for reader in range(plan.tasks)]
    documents, nbytes = (sum(r["normalised"][i] for r in reads) for i in (0, 1))
    at_read = Counter(
        {r: n for r, n in ledger.dropped.items() if not r.startswith("quality/") and r not in DROP_REASONS.values()}
    )
    report = [{"stage": "read+normalise", "documents_out": documents, "dropped": dict(at_read)}]
    stages = [("max_chars", lambda r: r == "quality/max_chars")]
    stages += [(f"{s}_dedup", lambda r, s=s: r == DEDUP_REASONS[s]) for s in DEDUP_REASONS if s in plan.stages]
    stages += [("quality", lambda r: r.startswith("quality/") and r != "quality/max_chars")]
    stages += [(s, lambda r, s=s: r == FILTER_REASONS[s]) for s in FILTER_REASONS if s in plan.stages]
    for name, belongs in stages:
        dropped = Counter({r: n for r, n in ledger.dropped.items() if belongs(r) and n})
        dropped_bytes = Counter({r: n for r, n in ledger.dropped_bytes.items() if belongs(r) and n})
        report.append(stage_entry(name, documents, nbytes, dropped, dropped_bytes))
        documents, nbytes = report[-1]["documents_out"], report[-1]["bytes_out"]
    return report


def _layout(plan: StagedPlan) -> dict[str, list[dict]]:
    """domain -> per read task, its part's documents, tokens and document-line bytes (zeros where it has none)."""
    parts = [plan.stats("tokenize", reader)["domains"] for reader in range(plan.tasks)]
    empty = {"documents": 0, "bytes": 0, "tokens": 0, "line_bytes": 0}
    return {d: [p.get(d, empty) for p in parts] for d in sorted({d for p in parts for d in p})}


def _npy_header(length: int) -> bytes:
    """The .npy header np.save writes for `length` int64 values."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<i8", "fortran_order": False, "shape": (length,)})
    return buffer.getvalue()


def _write_at(path: Path, offset: int, data: bytes | np.ndarray, block: int = 1 << 26) -> None:
    """Write `data` into `path` at `offset` without touching the rest: tasks fill one file side by side."""
    view = memoryview(np.ascontiguousarray(data)).cast("B")
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for start in range(0, len(view), block):
            os.pwrite(descriptor, view[start : start + block], offset + start)
    finally:
        os.close(descriptor)


def merge(plan: StagedPlan, reader: int, folder: Path) -> dict:
    """A read task's parts, written into the one-process files at their offsets (all merge tasks at once); the
    digests of the fingerprint's pieces that lie wholly within its tokens."""
    output, layout = Path(plan.output_dir), _layout(plan)
    dtype = token_dtype(GLMTokenizer.from_file(plan.task_dir("tokenizer", 0) / "tokenizer.json"))
    source, digests = plan.task_dir("tokenize", reader), {}
    for domain, parts in layout.items():
        if not parts[reader]["documents"]:
            continue
        for directory in (output / "documents", output / "tokens"):
            directory.mkdir(parents=True, exist_ok=True)
        before = {key: sum(p[key] for p in parts[:reader]) for key in ("documents", "tokens", "line_bytes")}
        lines = np.fromfile(source / f"{domain}.jsonl", np.uint8)
        _write_at(output / "documents" / f"{domain}.jsonl", before["line_bytes"], lines)
        tokens = np.fromfile(source / f"{domain}.bin", dtype)
        _write_at(output / "tokens" / f"{domain}.bin", before["tokens"] * tokens.itemsize, tokens)
        header = _npy_header(sum(p["documents"] for p in parts) + 1)
        ends = np.load(source / f"{domain}.idx.npy")[1:] + before["tokens"]
        _write_at(output / "tokens" / f"{domain}.idx.npy", 0, np.frombuffer(header + bytes(8), np.uint8))
        _write_at(output / "tokens" / f"{domain}.idx.npy", len(header) + 8 * (1 + before["documents"]), ends)
        total, start, end = sum(p["tokens"] for p in parts), before["tokens"], before["tokens"] + len(tokens)
        pieces = range(-(-start // CHUNK_TOKENS) * CHUNK_TOKENS, end, CHUNK_TOKENS)
        digests[domain] = {
            str(piece // CHUNK_TOKENS): chunk_digest(tokens[piece - start : piece - start + CHUNK_TOKENS]).hex()
            for piece in pieces
            if min(piece + CHUNK_TOKENS, total) <= end
        }
    return {
        "documents": sum(parts[reader]["documents"] for parts in layout.values()),
        "bytes": sum(parts[reader]["bytes"] for parts in layout.values()),
        "digests": digests,
    }


def finish(plan: StagedPlan, index: int, folder: Path) -> dict:
    """The files cut to their sizes, the fingerprint from the merge tasks' digests (the few pieces that straddle two
    tasks read back), shards.json, tokenizer.json, manifest.json, prepared.json; then the bulky work files go
    (the stats stay, for the progress table)."""
    output, layout = Path(plan.output_dir), _layout(plan)
    ledger = _merged_ledger(plan)
    kept = {d: {k: sum(p[k] for p in parts) for k in ("documents", "bytes")} for d, parts in layout.items()}
    settings = {"dedup": plan.dedup, "quality": plan.quality, "tasks": plan.tasks, "threads": plan.threads}
    manifest = build_manifest(ledger, _stage_report(plan, ledger), kept, settings)
    if "perplexity_model" in plan.stages:  # what the filter's model was, to tell two preparations apart
        fitted = plan.stats("perplexity_model", 0)
        manifest["models"] = {"perplexity": {k: fitted[k] for k in ("sha256", "ngrams", "documents", "cutoffs")}}
    if "quality_model" in plan.stages:
        fitted = plan.stats("quality_model", 0)
        manifest.setdefault("models", {})["quality_classifier"] = {
            k: fitted[k] for k in ("sha256", "trained", "min_score") if k in fitted
        }
    if "toxicity" in plan.stages:
        manifest.setdefault("models", {})["toxicity"] = toxicity_classifier()
    if "semantic_clusters" in plan.stages:
        fitted = plan.stats("semantic_clusters", 0)
        manifest.setdefault("models", {})["semantic_dedup"] = encoder_record() | {
            k: fitted[k] for k in ("documents", "clusters")
        }
    tasks = [plan.task_dir(stage, task) for stage in ("read", "tokenize") for task in range(plan.tasks)]
    excluded = join_excluded(tasks, output)  # even where nothing was kept; replaces an earlier preparation's
    if plan.keep_excluded:
        manifest["excluded"] = excluded
    (output / "manifest.json").write_text(json.dumps(manifest, indent=2))
    if not layout:  # before any token file is written: the counts say why
        raise EmptyDatasetError(empty_dataset_message(manifest, output))
    tokenizer_ = GLMTokenizer.from_file(plan.task_dir("tokenizer", 0) / "tokenizer.json")
    tokenizer_.save(output / "tokenizer.json")  # with a Hub tokenizer's own files beside it
    dtype, fingerprint, shards, read_back = token_dtype(tokenizer_), shards_fingerprint(tokenizer_), {}, 0
    known: dict[str, dict[str, str]] = {}
    for reader in range(plan.tasks):
        for domain, digests in plan.stats("merge", reader)["digests"].items():
            known.setdefault(domain, {}).update(digests)
    for directory, suffixes in ((output / "documents", (".jsonl",)), (output / "tokens", (".bin", ".idx.npy"))):
        for stale in directory.glob("*"):  # a domain an earlier attempt wrote, which this preparation has not
            if not any(stale.name == f"{d}{suffix}" for d in layout for suffix in suffixes):
                stale.unlink()
    for domain, parts in layout.items():
        documents, total = sum(p["documents"] for p in parts), sum(p["tokens"] for p in parts)
        os.truncate(output / "documents" / f"{domain}.jsonl", sum(p["line_bytes"] for p in parts))
        os.truncate(output / "tokens" / f"{domain}.bin", total * np.dtype(dtype).itemsize)
        os.truncate(output / "tokens" / f"{domain}.idx.npy", len(_npy_header(documents + 1)) + 8 * (documents + 1))
        tokens = np.memmap(output / "tokens" / f"{domain}.bin", dtype, mode="r") if total else np.zeros(0, dtype)
        fingerprint.update(domain.encode())
        for piece in range(0, total, CHUNK_TOKENS):
            digest = known.get(domain, {}).get(str(piece // CHUNK_TOKENS))
            if digest is None:
                read_back += 1
                digest = chunk_digest(np.asarray(tokens[piece : piece + CHUNK_TOKENS])).hex()
            fingerprint.update(bytes.fromhex(digest))
        shards[domain] = {"documents": documents, "tokens": total}
    write_index(output / "tokens", tokenizer_, dtype, fingerprint.hexdigest(), shards)
    mark_prepared(output, plan.fingerprint)
    for stage in plan.stages[:-1]:
        for task in plan.work.glob(f"{stage}/*/"):
            for item in task.iterdir():
                if item.name != "stats.json":
                    shutil.rmtree(item) if item.is_dir() else item.unlink()
    return {
        "documents": manifest["documents_out"],
        "bytes": manifest["bytes_out"],
        "tokens": sum(s["tokens"] for s in shards.values()),
        "pieces_read_back": read_back,
    }
