"""`task=prepare`: read -> normalise -> exact, URL and near-duplicate removal -> quality filters -> write.

The output folder holds `documents/<domain>.jsonl` and `manifest.json`, which accounts for every
input document: `documents_in == documents_out + sum(dropped.values())`, with bytes alike, per stage
and per domain, plus the file:line of the first unreadable inputs of each kind. A run that keeps no
document writes its manifest and raises EmptyDatasetError with the counts, instead of failing later
in tokenizer training or shard writing.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

from .dedup import dedup_exact, dedup_near, dedup_urls
from .documents import Document, Ledger, normalized
from .embedded import read_embedded
from .loop_progress import progress
from .quality import QualityRules, violation
from .sources import read_jsonl, read_parquet, read_text_folder

READERS = {"embedded": read_embedded, "jsonl": read_jsonl, "text": read_text_folder, "parquet": read_parquet}


class EmptyDatasetError(ValueError):
    """Preparation kept no document: the message gives the counts of every reason and stage."""


def normalize_document(doc: Document, ledger: Ledger) -> bool:
    """The text `normalized`, in place; False (and dropped) if left empty."""
    before = doc.nbytes
    doc.text = normalized(doc.text)
    ledger.trimmed_bytes += before - doc.nbytes
    if not doc.text:
        ledger.drop(doc, "empty")
    return bool(doc.text)


def normalize(docs: Iterable[Document], ledger: Ledger) -> list[Document]:
    return [doc for doc in progress(docs, desc="read+normalise", unit="doc") if normalize_document(doc, ledger)]


def length_filter(docs: list[Document], ledger: Ledger, rules: QualityRules) -> list[Document]:
    """The max_chars rule, applied before deduplication: a gigantic document is dropped for its length
    without first costing MinHash memory (about 20 bytes per character of a document)."""
    kept = []
    for doc in docs:
        if len(doc.text) > rules.max_chars:
            ledger.drop(doc, "quality/max_chars")
        else:
            kept.append(doc)
    return kept


def quality_filter(docs: list[Document], ledger: Ledger, rules: QualityRules) -> list[Document]:
    kept = []
    for doc in progress(docs, desc="quality", unit="doc"):
        rule = violation(doc, rules)
        if rule:
            ledger.drop(doc, f"quality/{rule}")
        else:
            kept.append(doc)
    return kept


def _totals(docs: list[Document]) -> tuple[int, int]:
    return len(docs), sum(d.nbytes for d in docs)


def stage_entry(name: str, documents_in: int, bytes_in: int, dropped: Counter, dropped_bytes: Counter) -> dict:
    """One stage's row of the manifest's `stages`: documents and bytes before and after, and what it dropped."""
    return {
        "stage": name,
        "documents_in": documents_in,
        "bytes_in": bytes_in,
        "documents_out": documents_in - sum(dropped.values()),
        "bytes_out": bytes_in - sum(dropped_bytes.values()),
        "dropped": dict(dropped),
    }


def run_pipeline(docs: Iterable[Document], ledger: Ledger, stages: list[tuple[str, Callable]]) -> tuple[list, list]:
    """Apply the stages in order; record documents and bytes before/after each and what it dropped."""
    report = []
    current = normalize(docs, ledger)
    report.append({"stage": "read+normalise", "documents_out": len(current), "dropped": dict(ledger.dropped)})
    for name, stage in stages:
        before, dropped, dropped_bytes = _totals(current), Counter(ledger.dropped), Counter(ledger.dropped_bytes)
        current = stage(current, ledger)
        report.append(stage_entry(name, *before, ledger.dropped - dropped, ledger.dropped_bytes - dropped_bytes))
    return current, report


def document_line(doc: Document) -> str:
    """A kept document as one line of documents/<domain>.jsonl."""
    return json.dumps({"text": doc.text, "id": doc.id, "url": doc.url, "source": doc.source}) + "\n"


def build_manifest(ledger: Ledger, report: list, domains: dict, settings: dict) -> dict:
    """manifest.json: every input accounted for (`domains`: domain -> kept documents and bytes)."""
    documents_out = sum(d["documents"] for d in domains.values())
    manifest = {
        "command": " ".join(sys.argv),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "documents_in": ledger.documents_in,
        "documents_out": documents_out,
        "dropped": dict(ledger.dropped),
        "bytes_in": ledger.bytes_in,
        "bytes_out": sum(d["bytes"] for d in domains.values()),
        "bytes_dropped": dict(ledger.dropped_bytes),
        "bytes_trimmed": ledger.trimmed_bytes,  # whitespace and line ends removed by normalisation
        "files": ledger.files,  # input files read (not counted by the embedded reader)
        "empty_files": ledger.empty_files,  # the first of them that held no input (no line, no row)
        "domains": dict(sorted(domains.items())),
        "stages": report,
        "examples": ledger.examples,
        "settings": settings,
    }
    assert manifest["documents_in"] == documents_out + sum(ledger.dropped.values()), "a document went missing"
    return manifest


def write_dataset(docs: list[Document], ledger: Ledger, report: list, output_dir: Path, settings: dict) -> dict:
    (output_dir / "documents").mkdir(parents=True, exist_ok=True)
    for stale in (output_dir / "documents").glob("*.jsonl"):  # an earlier run's domains would be tokenized too
        stale.unlink()
    by_domain = defaultdict(list)
    for doc in docs:
        by_domain[doc.domain].append(doc)
    for domain, domain_docs in by_domain.items():
        with open(output_dir / "documents" / f"{domain}.jsonl", "w") as f:
            f.writelines(map(document_line, domain_docs))
    domains = {d: {"documents": len(v), "bytes": sum(x.nbytes for x in v)} for d, v in by_domain.items()}
    manifest = build_manifest(ledger, report, domains, settings)
    (output_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def prepare(
    docs: Iterable[Document],
    ledger: Ledger,
    output_dir: str | Path,
    dedup: dict,
    quality: QualityRules,
    num_workers: int = 1,
) -> dict:
    stages = [("max_chars", lambda d, led: length_filter(d, led, quality))]
    if dedup.get("exact", True):
        stages.append(("exact_dedup", dedup_exact))
    if dedup.get("url", True):
        stages.append(("url_dedup", dedup_urls))
    if dedup.get("near", True):
        near = {k: dedup[k] for k in ("threshold", "num_perm", "shingle_size", "seed") if k in dedup}
        stages.append(("near_dedup", lambda d, led: dedup_near(d, led, num_workers=num_workers, **near)))
    stages.append(("quality", lambda d, led: quality_filter(d, led, quality)))
    kept, report = run_pipeline(docs, ledger, stages)
    settings = {"dedup": dedup, "quality": vars(quality), "num_workers": num_workers}
    manifest = write_dataset(kept, ledger, report, Path(output_dir), settings)
    if not kept:
        raise EmptyDatasetError(empty_dataset_message(manifest, Path(output_dir)))
    return manifest


def empty_dataset_message(manifest: dict, output_dir: Path) -> str:
    """What EmptyDatasetError says: no input at all, or every reason and stage that dropped documents."""
    if not manifest["documents_in"]:
        empty = manifest["empty_files"]
        listed = f" ({len(empty)} empty: {', '.join(empty[:3])})" if empty else ""
        return f"no documents in the input: {manifest['files']} file(s) read{listed}"
    dropped = ", ".join(f"{reason} {count}" for reason, count in sorted(manifest["dropped"].items()))
    stages = ", ".join(
        f"{s['stage']} {s.get('documents_in', manifest['documents_in'])} -> {s['documents_out']}"
        for s in manifest["stages"]
        if s["dropped"] or s["stage"] == "read+normalise"
    )
    return (
        f"no documents left after filtering: {manifest['documents_in']} in, 0 out; dropped: {dropped}; "
        f"per stage: {stages}; the first file:line of each reason in {output_dir / 'manifest.json'}"
    )
