"""What `task=prepare` reads and what it reports: the readers, normalisation, the lines of documents/<domain>.jsonl,
and the manifest (the stages that fill them: glm46.data.staged).

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
from collections import Counter
from pathlib import Path

from glm46.errors import ConfigError

from .chat_formats import read_chat
from .documents import Document, Ledger, normalized
from .embedded import read_embedded
from .hf_source import hf_inputs, read_hf
from .preference import read_preference
from .sources import SUFFIXES, TEXT_SUFFIXES, files_of, read_jsonl, read_parquet, read_text_folder

READERS = {
    "embedded": read_embedded,
    "jsonl": read_jsonl,
    "chat": read_chat,
    "text": read_text_folder,
    "parquet": read_parquet,
    "preference": read_preference,
    "hf": read_hf,
}
# The source's fields a reader takes besides its options, with their defaults: the record fields of the text and id
RECORD_KEYS = {"text_key": "text", "id_key": "id"}
READER_KEYS = {"jsonl": RECORD_KEYS, "parquet": RECORD_KEYS, "hf": RECORD_KEYS | {"split": "train"}}
SOURCE_KEYS = RECORD_KEYS | {"split": None}  # a source's defaults (the schema's SourceData)


def reader_options(source: dict) -> dict:
    """The keyword arguments of `source`'s reader: source.options and the fields of READER_KEYS (source.text_key,
    id_key; split for source=hf). A field set for a reader that does not take it is a ConfigError."""
    reader, taken = source["reader"], READER_KEYS.get(source["reader"], {})
    for key, default in SOURCE_KEYS.items():
        if key not in taken and source.get(key, default) not in (None, default):
            users = ", ".join(f"source={name}" for name, keys in READER_KEYS.items() if key in keys)
            raise ConfigError(f"source.{key}={source[key]}: source={reader} has no use for it (it is read by {users})")
    fields = {key: source.get(key) or default for key, default in taken.items()}
    return dict(source.get("options") or {}) | fields


def input_files(reader: str, paths: list[str], options: dict | None = None) -> list[Path]:
    """The files a file reader reads, in its order: what a staged preparation splits over its tasks (source=hf:
    a folder written by save_to_disk is one input, a folder in the Hub's layout its split's data files)."""
    if reader == "hf":
        return hf_inputs(paths, (options or {}).get("split", "train"))
    suffixes = SUFFIXES.get(reader) or tuple((options or {}).get("suffixes", TEXT_SUFFIXES))
    return files_of(paths, suffixes)


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
