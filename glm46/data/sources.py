"""Readers for user data: JSON records (JSONL, JSON arrays, plain or compressed), plain-text folders and parquet
(conversations: glm46.data.chat_formats; preference pairs: glm46.data.preference). Unreadable input is counted in the
ledger with its file and line, never raised and never silently skipped; what cannot be counted (a missing path, a
folder without input files, a file of a format the reader does not read, a parquet file whose footer does not read)
is an error naming the path, raised before the first document is read."""

from __future__ import annotations

import codecs
import glob
import json
import re
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import zstandard

from .documents import Document, Ledger

# A domain names files (documents/<domain>.jsonl, tokens/<domain>.bin) and mixture keys.
DOMAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}  # decompressed by extension
JSON_SUFFIXES = tuple(kind + codec for kind in (".jsonl", ".json") for codec in ("", *COMPRESSIONS))
SUFFIXES = {
    "jsonl": JSON_SUFFIXES,
    "chat": JSON_SUFFIXES,
    "preference": JSON_SUFFIXES,
    "parquet": (".parquet",),
    "hf": (".parquet", *JSON_SUFFIXES),  # the data files of a folder in the Hub's layout (glm46.data.hf_source)
}  # the input files of each file reader
TEXT_SUFFIXES = (".txt", ".md")  # read_text_folder's default
CHUNK = 1 << 20  # bytes read at a time
JSON_TYPES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    type(None): "null",
}


class BrokenStream(Exception):
    """A compressed file whose stream stops decoding (cut off, corrupt): what came before it stands.
    `nbytes`: the decompressed bytes of the line it breaks in."""

    def __init__(self, detail: str, nbytes: int = 0) -> None:
        super().__init__(detail)
        self.nbytes = nbytes


def expanded_paths(paths: list[str]) -> list[Path]:
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


def formats(suffixes: tuple[str, ...]) -> str:
    """What files of these suffixes are, for a message: `.jsonl or .json files, plain or compressed (.gz, .zst)`."""
    kinds = list(dict.fromkeys(_kind(suffix) for suffix in suffixes))
    compressed = any(_compression(suffix) for suffix in suffixes)
    return f"{' or '.join(kinds)} files" + (f", plain or compressed ({', '.join(COMPRESSIONS)})" if compressed else "")


def _compression(name: str | Path) -> str | None:
    """`gzip` or `zstd` for a name that ends in .gz or .zst, else None."""
    return next((codec for suffix, codec in COMPRESSIONS.items() if str(name).endswith(suffix)), None)


def _kind(name: str | Path) -> str:
    """The suffix of a name's format, without its compression: `.jsonl` for data.jsonl.gz (and for .jsonl.gz)."""
    name = Path(name).name
    for suffix in COMPRESSIONS:
        name = name.removesuffix(suffix)
    return "." + name.rsplit(".", 1)[1] if "." in name else ""


def files_of(paths: list[str], suffixes: tuple[str, ...]) -> list[Path]:
    files = []
    for path in expanded_paths(paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(suffixes))
            if not found:
                raise FileNotFoundError(f"source.paths: {path} holds no {formats(suffixes)}")
            files += found
        elif not path.exists():
            raise FileNotFoundError(f"source.paths: {path} does not exist")
        elif not path.name.endswith(suffixes):
            raise ValueError(f"source.paths: {path} is of no format this source reads: it reads {formats(suffixes)}")
        else:
            files.append(path)
    return files


def _chunks(file: Path) -> Iterator[bytes]:
    """The bytes of `file`, decompressed by its extension (.gz, .zst: concatenated members or frames too);
    BrokenStream where a compressed stream is cut off or corrupt."""
    codec = _compression(file)
    with open(file, "rb") as f:
        if codec is None:
            yield from iter(lambda: f.read(CHUNK), b"")
        else:
            yield from _decompressed(f, codec)


def _decompressor(codec: str):
    """A decompressor of one gzip member or zstd frame (`eof` once it ends, then `unused_data`)."""
    if codec == "gzip":
        return zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # the gzip header and trailer
    return zstandard.ZstdDecompressor().decompressobj()


def _decompressed(f, codec: str) -> Iterator[bytes]:
    """The decompressed bytes of an open file of gzip members (zstd frames), one after another."""
    decompressor, inside = _decompressor(codec), False  # inside: a member (frame) begun and not ended
    try:
        while chunk := f.read(CHUNK):
            while chunk:
                yield decompressor.decompress(chunk)
                inside = not decompressor.eof
                if inside:
                    break
                chunk, decompressor = decompressor.unused_data, _decompressor(codec)  # the next member
    except (zlib.error, zstandard.ZstdError) as error:
        raise BrokenStream(f"the {codec} stream is corrupt ({error})") from None
    if inside:
        raise BrokenStream(f"the {codec} stream is cut off (the file ends inside it)")


def _lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a stream of chunks, each with its newline (the last: where the file has one)."""
    pending: list[bytes] = []  # the line begun in earlier chunks
    try:
        for chunk in chunks:
            *lines, last = chunk.split(b"\n")
            if lines:
                lines[0] = b"".join(pending) + lines[0]
                pending = []
                yield from (line + b"\n" for line in lines)
            pending.append(last)
    except BrokenStream as error:
        raise BrokenStream(str(error), sum(map(len, pending))) from None
    if rest := b"".join(pending):
        yield rest


def json_kind(value: object) -> str:
    return JSON_TYPES.get(type(value), type(value).__name__)


def _problem(record: object, text_key: str = "text") -> str | None:
    """Why a record cannot be a document (its text in the field `text_key`), or None."""
    if not isinstance(record, dict):
        return f"{json_kind(record)}, not an object with a string field {text_key!r}"
    if text_key not in record:
        return f"no field {text_key!r} (fields: {', '.join(map(str, list(record)[:10])) or 'none'})"
    if not isinstance(record[text_key], str):
        return f"field {text_key!r} is {json_kind(record[text_key])}, not a string"
    return domain_problem(record)


def domain_problem(record: dict) -> str | None:
    domain = record.get("domain")
    if domain not in (None, "") and not (isinstance(domain, str) and DOMAIN.fullmatch(domain)):
        return f"field 'domain' is {repr(domain)[:60]}, not a name of letters, digits, '_', '-' and '.'"
    return None


def record_document(
    record,
    where: str,
    ledger: Ledger,
    default_domain: str,
    nbytes: int = 0,
    text_key: str = "text",
    id_key: str = "id",
) -> Document | None:
    """A JSON record or parquet row {text_key: str, optional "url", id_key, "domain"} -> Document, or counted."""
    problem = _problem(record, text_key)
    if problem:
        ledger.reject("malformed", where, problem, nbytes)
        return None
    what = f"field {text_key!r}"
    return admit_record(record[text_key], what, record, where, ledger, default_domain, nbytes, id_key)


def admit_record(
    text: str,
    what: str,
    record: dict,
    where: str,
    ledger: Ledger,
    default_domain: str,
    nbytes: int,
    id_key: str = "id",
) -> Document | None:
    """`text` as the document of `record` (its optional url, id and domain), or counted as undecodable."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:  # a "\ud800" escape: valid JSON, but no Unicode text
        ledger.reject("undecodable", where, f"{what}: {error.reason} ({text[error.start]!r})", nbytes)
        return None
    url, key = record.get("url"), record.get(id_key)
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
    """(record, where, bytes) of every JSON record of the files: each line of a .jsonl ("file:line"), each element
    of a .json holding an array ("file:item N", from 0), each line of a .json of lines; .gz and .zst files
    decompressed. What does not decode is counted (undecodable, malformed) where it is; blank lines skipped."""
    for file in files_of(paths, SUFFIXES["jsonl"]):
        before = ledger.documents_in
        yield from _json_records(file, ledger) if _kind(file) == ".json" else _line_records(file, ledger)
        ledger.read_file(file, before)


def _line_records(file: Path, ledger: Ledger, data: bytes | None = None) -> Iterator[tuple[object, str, int]]:
    """The records of `file`'s lines (of `data`, its bytes, when already read). A compressed stream that breaks
    keeps the lines before it and counts the rest as one undecodable input at the line it breaks in."""
    number = 0
    try:
        for number, raw in enumerate(_lines(_chunks(file) if data is None else [data]), start=1):
            yield from _line_record(raw, f"{file}:{number}", number == 1, ledger)
    except BrokenStream as error:
        ledger.reject("undecodable", f"{file}:{number + 1}", f"{error}: what follows line {number}", error.nbytes)


def _line_record(raw: bytes, where: str, first: bool, ledger: Ledger) -> Iterator[tuple[object, str, int]]:
    """The record of a line, or nothing: a blank line (not a document), or one that does not decode (counted)."""
    if not raw.strip():
        return
    try:  # a byte-order mark (some Windows editors write one) may open the file
        record = json.loads(raw.rstrip(b"\r\n").decode("utf-8-sig" if first else "utf-8"))
    except UnicodeDecodeError as error:
        ledger.reject("undecodable", where, str(error), len(raw))
    except json.JSONDecodeError as error:
        ledger.reject("malformed", where, f"{error.msg} (column {error.colno})", len(raw))
    else:
        yield record, where, len(raw)


def _json_records(file: Path, ledger: Ledger) -> Iterator[tuple[object, str, int]]:
    """A .json file, read whole: the elements of its top-level array, else its lines (JSON Lines named .json).
    An array that does not parse, one value over several lines that is no array, or a compressed stream that
    breaks is one input counted at the file."""
    try:
        data = b"".join(_chunks(file))
    except BrokenStream as error:
        ledger.reject("undecodable", str(file), f"{error} (a .json file is read whole)")
        return
    array = data.removeprefix(codecs.BOM_UTF8).lstrip().startswith(b"[")
    try:
        value = json.loads(data.decode("utf-8-sig"))
    except ValueError as error:  # UnicodeDecodeError too
        if not array:
            yield from _line_records(file, ledger, data)
            return
        reason = "undecodable" if isinstance(error, UnicodeDecodeError) else "malformed"
        ledger.reject(reason, str(file), f"a JSON array that does not parse: {error}", len(data))
        return
    if isinstance(value, list):
        for number, item in enumerate(value):
            yield item, f"{file}:item {number}", len(json.dumps(item, ensure_ascii=False).encode("utf-8", "replace"))
    elif lines := data.strip().count(b"\n"):
        detail = f"{json_kind(value)} over {lines + 1} lines: a .json file holds an array of records or one per line"
        ledger.reject("malformed", str(file), detail, len(data))
    else:
        yield from _line_records(file, ledger, data)  # one line: one record


def read_jsonl(
    paths: list[str], ledger: Ledger, default_domain: str = "general", text_key: str = "text", id_key: str = "id"
) -> Iterator[Document]:
    """One document per JSON record (jsonl_records): its text in the field `text_key`, its id in `id_key`."""
    for record, where, nbytes in jsonl_records(paths, ledger):
        doc = record_document(record, where, ledger, default_domain, nbytes, text_key, id_key)
        if doc is not None:
            yield doc


def read_parquet(
    paths: list[str], ledger: Ledger, default_domain: str = "general", text_key: str = "text", id_key: str = "id"
) -> Iterator[Document]:
    """One document per row, its text in the column `text_key` and its id in `id_key` (parquet_documents)."""
    files = files_of(paths, SUFFIXES["parquet"])
    check_parquet(files)
    for file in files:
        yield from parquet_documents(file, ledger, default_domain, text_key, id_key)


def check_parquet(files: list[Path]) -> None:
    """Every footer before the first document: a file that does not open at all fails here, naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for file in files:
        try:
            pq.read_metadata(file)
        except (pa.ArrowException, OSError) as error:
            raise ValueError(f"source.paths: {file} is not a readable parquet file ({error})") from None


def parquet_documents(
    file: Path, ledger: Ledger, default_domain: str, text_key: str = "text", id_key: str = "id"
) -> Iterator[Document]:
    """One document per row, read one row group at a time. A file without the text column counts all its
    rows as malformed, a row group that does not read (corrupt pages) all of its rows as undecodable."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    before = ledger.documents_in
    parquet = pq.ParquetFile(file)
    names, rows = parquet.schema_arrow.names, parquet.metadata.num_rows
    if not lacks_text_column(str(file), names, rows, text_key, ledger):
        columns = record_columns(names, text_key, id_key)
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
                doc = record_document(record, f"{file}:row {row}", ledger, default_domain, 0, text_key, id_key)
                if doc is not None:
                    yield doc
            first += size
    ledger.read_file(file, before)


def record_columns(names: list[str], text_key: str, id_key: str) -> list[str]:
    """The columns of a table that a document takes."""
    return [c for c in dict.fromkeys((text_key, "url", id_key, "domain")) if c in names]


def lacks_text_column(where: str, names: list[str], rows: int, text_key: str, ledger: Ledger) -> bool:
    """Whether a table of `rows` rows has no column `text_key`: then every row is counted as malformed."""
    if text_key in names:
        return False
    if rows:
        detail = f"no column {text_key!r} (columns: {', '.join(names) or 'none'})"
        ledger.reject("malformed", f"{where}:rows 0-{rows - 1}", detail, count=rows)
    return True


def read_text_folder(
    paths: list[str], ledger: Ledger, default_domain: str = "general", suffixes: tuple[str, ...] = TEXT_SUFFIXES
) -> Iterator[Document]:
    """One document per file."""
    for file in files_of(paths, tuple(suffixes)):
        before, raw = ledger.documents_in, file.read_bytes()
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as error:
            ledger.reject("undecodable", str(file), str(error), len(raw))
        else:
            yield ledger.admit(Document(text=text, domain=default_domain, source=str(file), id=str(file)))
        ledger.read_file(file, before)
