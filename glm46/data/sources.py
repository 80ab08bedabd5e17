"""Readers for user data: JSONL, plain-text folders and parquet. Unreadable input is counted in the
ledger with its file and line, never raised and never silently skipped."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from .documents import Document, Ledger


def _files(paths: list[str], suffixes: tuple[str, ...]) -> list[Path]:
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(suffixes))
        elif path.exists():
            files.append(path)
        else:
            raise FileNotFoundError(f"data.paths: {path} does not exist")
    return files


def _from_record(record, where: str, ledger: Ledger, default_domain: str, nbytes: int = 0) -> Document | None:
    """A JSONL line or parquet row {"text": str, optional "url", "id", "domain"} -> Document, or counted."""
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        ledger.reject("malformed", where, "no string field 'text'", nbytes)
        return None
    url, key = record.get("url"), record.get("id")
    return ledger.admit(Document(
        text=text, domain=str(record.get("domain") or default_domain), source=where,
        id=where if key is None else str(key), url=url if isinstance(url, str) else None,
    ))


def read_jsonl(paths: list[str], ledger: Ledger, default_domain: str = "general") -> Iterator[Document]:
    for file in _files(paths, (".jsonl", ".json")):
        with open(file, "rb") as f:
            for number, raw in enumerate(f, start=1):
                where = f"{file}:{number}"
                if not raw.strip():
                    continue  # blank lines are not documents
                try:
                    record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as error:
                    ledger.reject("undecodable", where, str(error), len(raw))
                    continue
                except json.JSONDecodeError as error:
                    ledger.reject("malformed", where, error.msg, len(raw))
                    continue
                doc = _from_record(record, where, ledger, default_domain, len(raw))
                if doc is not None:
                    yield doc


def read_parquet(paths: list[str], ledger: Ledger, default_domain: str = "general") -> Iterator[Document]:
    import pyarrow.parquet as pq

    for file in _files(paths, (".parquet",)):
        for row, record in enumerate(pq.read_table(file).to_pylist()):
            doc = _from_record(record, f"{file}:row {row}", ledger, default_domain)
            if doc is not None:
                yield doc


def read_text_folder(paths: list[str], ledger: Ledger, default_domain: str = "general",
                     suffixes: tuple[str, ...] = (".txt", ".md")) -> Iterator[Document]:
    """One document per file."""
    for file in _files(paths, suffixes):
        raw = file.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            ledger.reject("undecodable", str(file), str(error), len(raw))
            continue
        yield ledger.admit(Document(text=text, domain=default_domain, source=str(file), id=str(file)))
