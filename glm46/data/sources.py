"""Readers for user data: JSONL documents, JSONL conversations, plain-text folders and parquet. Unreadable input
is counted in the ledger with its file and line, never raised and never silently skipped; what cannot be counted (a
missing path, a folder without input files, a parquet file whose footer does not read) is an error
naming the path, raised before the first document is read."""

from __future__ import annotations

import glob
import json
import re
from collections.abc import Iterator
from pathlib import Path

from .chat import conversation_problem, render_chat
from .documents import Document, Ledger

# A domain names files (documents/<domain>.jsonl, tokens/<domain>.bin) and mixture keys.
DOMAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
SUFFIXES = {
    "jsonl": (".jsonl", ".json"),
    "chat": (".jsonl", ".json"),
    "preference": (".jsonl", ".json"),
    "parquet": (".parquet",),
}  # the input files of each file reader
TEXT_SUFFIXES = (".txt", ".md")  # read_text_folder's default
JSON_TYPES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    type(None): "null",
}


def _expand(paths: list[str]) -> list[Path]:
    """Each path as given, or the sorted matches of a glob pattern (`data/*.jsonl`) that is no existing path."""
    expanded = []
    for path in paths:
        if not Path(path).exists() and glob.has_magic(path):
            matches = sorted(glob.glob(path, recursive=True))
            if not matches:
                raise FileNotFoundError(f"source.paths: {path} matches nothing")
            expanded += map(Path, matches)
        else:
            expanded.append(Path(path))
    return expanded


def input_files(reader: str, paths: list[str], options: dict | None = None) -> list[Path]:
    """The files a file reader reads, in its order: what a staged preparation splits over its tasks."""
    suffixes = SUFFIXES.get(reader) or tuple((options or {}).get("suffixes", TEXT_SUFFIXES))
    return _files(paths, suffixes)


def _files(paths: list[str], suffixes: tuple[str, ...]) -> list[Path]:
    files = []
    for path in _expand(paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(suffixes))
            if not found:
                raise FileNotFoundError(f"source.paths: {path} holds no {' or '.join(suffixes)} files")
            files += found
        elif path.exists():
            files.append(path)
        else:
            raise FileNotFoundError(f"source.paths: {path} does not exist")
    return files


def json_kind(value: object) -> str:
    return JSON_TYPES.get(type(value), type(value).__name__)


def _problem(record: object) -> str | None:
    """Why a record cannot be a document, or None."""
    if not isinstance(record, dict):
        return f"{json_kind(record)}, not an object with a string field 'text'"
    if "text" not in record:
        return f"no field 'text' (fields: {', '.join(map(str, list(record)[:10])) or 'none'})"
    if not isinstance(record["text"], str):
        return f"field 'text' is {json_kind(record['text'])}, not a string"
    return domain_problem(record)


def domain_problem(record: dict) -> str | None:
    domain = record.get("domain")
    if domain not in (None, "") and not (isinstance(domain, str) and DOMAIN.fullmatch(domain)):
        return f"field 'domain' is {repr(domain)[:60]}, not a name of letters, digits, '_', '-' and '.'"
    return None


def _from_record(record, where: str, ledger: Ledger, default_domain: str, nbytes: int = 0) -> Document | None:
    """A JSONL line or parquet row {"text": str, optional "url", "id", "domain"} -> Document, or counted."""
    problem = _problem(record)
    if problem:
        ledger.reject("malformed", where, problem, nbytes)
        return None
    return admit_record(record["text"], "field 'text'", record, where, ledger, default_domain, nbytes)


def admit_record(
    text: str, what: str, record: dict, where: str, ledger: Ledger, default_domain: str, nbytes: int
) -> Document | None:
    """`text` as the document of `record` (its optional url, id and domain), or counted as undecodable."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:  # a "\ud800" escape: valid JSON, but no Unicode text
        ledger.reject("undecodable", where, f"{what}: {error.reason} ({text[error.start]!r})", nbytes)
        return None
    url, key = record.get("url"), record.get("id")
    return ledger.admit(
        Document(
            text=text,
            domain=record.get("domain") or default_domain,
            source=where,
            id=where if key is None else str(key),
            url=url if isinstance(url, str) else None,
        )
    )


def jsonl_records(paths: list[str], ledger: Ledger) -> Iterator[tuple[object, str, int]]:
    """(record, "file:line", bytes) of every JSONL line that decodes; the others counted (undecodable,
    malformed) at their file and line; blank lines skipped."""
    for file in _files(paths, SUFFIXES["jsonl"]):
        before = ledger.documents_in
        with open(file, "rb") as f:
            for number, raw in enumerate(f, start=1):
                where = f"{file}:{number}"
                if not raw.strip():
                    continue  # blank lines are not documents
                try:  # a byte-order mark (some Windows editors write one) may open the file
                    record = json.loads(raw.rstrip(b"\r\n").decode("utf-8-sig" if number == 1 else "utf-8"))
                except UnicodeDecodeError as error:
                    ledger.reject("undecodable", where, str(error), len(raw))
                    continue
                except json.JSONDecodeError as error:
                    ledger.reject("malformed", where, f"{error.msg} (column {error.colno})", len(raw))
                    continue
                yield record, where, len(raw)
        ledger.read_file(file, before)


def read_jsonl(paths: list[str], ledger: Ledger, default_domain: str = "general") -> Iterator[Document]:
    for record, where, nbytes in jsonl_records(paths, ledger):
        doc = _from_record(record, where, ledger, default_domain, nbytes)
        if doc is not None:
            yield doc


def read_chat(paths: list[str], ledger: Ledger, default_domain: str = "sft") -> Iterator[Document]:
    """Conversations as JSONL in the OpenAI messages format, one per line: {"messages": [...], optional "tools",
    "id", "domain"}, each rendered in GLM-4.6's chat format (glm46.data.chat). A conversation that cannot be
    trained on is counted under chat/<reason> (glm46.data.chat.conversation_problem) at its file and line."""
    for record, where, nbytes in jsonl_records(paths, ledger):
        if not isinstance(record, dict) or "messages" not in record:
            ledger.reject("malformed", where, f"{json_kind(record)}, not an object with a field 'messages'", nbytes)
            continue
        problem = conversation_problem(record["messages"], record.get("tools"))
        if problem is None and (domain := domain_problem(record)):
            problem = ("malformed", domain)
        if problem:
            reason, detail = problem
            ledger.reject(reason if reason == "malformed" else f"chat/{reason}", where, detail, nbytes)
            continue
        text = render_chat(record["messages"], record.get("tools"))
        doc = admit_record(text, "the conversation", record, where, ledger, default_domain, nbytes)
        if doc is not None:
            yield doc


def read_parquet(paths: list[str], ledger: Ledger, default_domain: str = "general") -> Iterator[Document]:
    """One document per row, read one row group at a time. A file without a `text` column counts all its
    rows as malformed, a row group that does not read (corrupt pages) all of its rows as undecodable."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = _files(paths, SUFFIXES["parquet"])
    for file in files:  # every footer before the first document: a file that does not open at all fails here
        try:
            pq.read_metadata(file)
        except (pa.ArrowException, OSError) as error:
            raise ValueError(f"source.paths: {file} is not a readable parquet file ({error})") from None
    for file in files:
        before = ledger.documents_in
        parquet = pq.ParquetFile(file)
        names, rows = parquet.schema_arrow.names, parquet.metadata.num_rows
        if "text" not in names:
            if rows:
                ledger.reject(
                    "malformed",
                    f"{file}:rows 0-{rows - 1}",
                    f"no column 'text' (columns: {', '.join(names) or 'none'})",
                    count=rows,
                )
        else:
            columns = [c for c in ("text", "url", "id", "domain") if c in names]
            first = 0
            for group in range(parquet.num_row_groups):
                size = parquet.metadata.row_group(group).num_rows
                try:
                    records = parquet.read_row_group(group, columns=columns).to_pylist()
                except (pa.ArrowException, OSError) as error:
                    ledger.reject(
                        "undecodable",
                        f"{file}:rows {first}-{first + size - 1}",
                        f"row group {group} does not read ({' '.join(str(error).split())})",
                        count=size,
                    )
                    records = []
                for row, record in enumerate(records, start=first):
                    doc = _from_record(record, f"{file}:row {row}", ledger, default_domain)
                    if doc is not None:
                        yield doc
                first += size
        ledger.read_file(file, before)


def read_text_folder(
    paths: list[str], ledger: Ledger, default_domain: str = "general", suffixes: tuple[str, ...] = TEXT_SUFFIXES
) -> Iterator[Document]:
    """One document per file."""
    for file in _files(paths, tuple(suffixes)):
        before, raw = ledger.documents_in, file.read_bytes()
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as error:
            ledger.reject("undecodable", str(file), str(error), len(raw))
        else:
            yield ledger.admit(Document(text=text, domain=default_domain, source=str(file), id=str(file)))
        ledger.read_file(file, before)
