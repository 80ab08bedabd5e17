"""Documents and the ledger that accounts for every one of them through the preparation pipeline."""

from __future__ import annotations

import unicodedata
from collections import Counter
from dataclasses import dataclass, field


def normalized(text: str) -> str:
    """What preparation makes of every text: Unicode NFC, Unix newlines, no surrounding blank space."""
    return unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n")).strip()


@dataclass
class Document:
    text: str
    domain: str = "general"
    source: str = ""  # file (and line) it came from
    id: str = ""
    url: str | None = None
    key: str | None = None  # what exact deduplication compares when not the text (a preference pair's prompt)

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))


def excluded_record(reason: str, source: str, text: str | None = None, **fields) -> dict:
    """One dropped input as `prepare.keep_excluded` writes it (glm46.data.staged.excluded): its reason, source
    (file:line), text and whatever else is known (id, score, detail, count), None fields left out."""
    return {"reason": reason, "source": source, "text": text} | {k: v for k, v in fields.items() if v is not None}


@dataclass
class Ledger:
    """Counts documents and bytes in, out and dropped per reason; keeps examples of unreadable input.

    The invariant `documents_in == documents_out + sum(dropped)` holds by construction: a document
    enters once (`admit`, or `reject` for input that never became a document) and leaves once. Bytes
    balance too, with the whitespace that normalisation trims counted in `trimmed_bytes`.
    """

    documents_in: int = 0
    bytes_in: int = 0
    dropped: Counter = field(default_factory=Counter)
    dropped_bytes: Counter = field(default_factory=Counter)
    trimmed_bytes: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> first few "file:line: detail"
    max_examples: int = 20
    files: int = 0  # input files read
    empty_files: list[str] = field(default_factory=list)  # the first few of them that held no input at all
    excluded: list[dict] | None = None  # a list to receive every drop's excluded_record (prepare.keep_excluded)

    def admit(self, doc: Document) -> Document:
        self.documents_in += 1
        self.bytes_in += doc.nbytes
        return doc

    def reject(self, reason: str, where: str, detail: str = "", nbytes: int = 0, count: int = 1) -> None:
        """Input that could not become a document (a malformed line, undecodable bytes); `count` inputs
        at once for a whole unreadable block (a parquet file without a `text` column, a corrupt row group)."""
        self.documents_in += count
        self.bytes_in += nbytes
        self._drop(reason, nbytes, f"{where}: {detail}" if detail else where, count)
        if self.excluded is not None:
            block = count if count > 1 else None
            self.excluded.append(excluded_record(reason, where, detail=detail or None, count=block))

    def read_file(self, file: object, inputs_before: int) -> None:
        """Count a file read; remember it if it held no input (`inputs_before`: documents_in before it)."""
        self.files += 1
        if self.documents_in == inputs_before and len(self.empty_files) < self.max_examples:
            self.empty_files.append(str(file))

    def drop(self, doc: Document, reason: str) -> None:
        self._drop(reason, doc.nbytes, doc.source)
        if self.excluded is not None:
            self.excluded.append(excluded_record(reason, doc.source, doc.text, id=doc.id or None))

    def _drop(self, reason: str, nbytes: int, example: str, count: int = 1) -> None:
        self.dropped[reason] += count
        self.dropped_bytes[reason] += nbytes
        examples = self.examples.setdefault(reason, [])
        if len(examples) < self.max_examples:
            examples.append(example)
