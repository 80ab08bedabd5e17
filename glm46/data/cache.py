"""Prepare a dataset once: `task=prepare`'s output folder is reused while the preparation's fingerprint
stays the same, and rebuilt when it changes.

The fingerprint covers everything that decides the output: the reader, its options and the source's
text_key, id_key and split, the `prepare` settings (dedup, quality rules, tokenizer), the source files (path,
size and modification time of each file read; for the embedded corpus, the standard library, pydoc topics and
license texts) and the source code of glm46.data. It is written to `<output_dir>/prepared.json` after a successful
preparation, with the shards' own content fingerprint, so an interrupted preparation, or another `task=prepare` into
the same folder, is not mistaken for this one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .embedded import source_files as embedded_source_files
from .prepare import SOURCE_KEYS

CODE_DIR = Path(__file__).resolve().parent
RECORD = "prepared.json"


def _files_under(paths: list[str]) -> list[Path]:
    files = []
    for path in map(Path, paths):
        files += sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return files


def source_signature(reader: str, paths: list[str]) -> str:
    """A digest of (path, size, mtime) of every source file, and of glm46.data's code."""
    files = embedded_source_files() if reader == "embedded" else _files_under(paths)
    digest = hashlib.blake2b(digest_size=16)
    for path in files + sorted(CODE_DIR.glob("*.py")):
        stat = path.stat() if path.exists() else None
        digest.update(f"{path}\0{stat.st_size if stat else -1}\0{stat.st_mtime_ns if stat else -1}\n".encode())
    return digest.hexdigest()


def _model_given(settings: dict) -> bool:
    return bool(settings.get("reference_domains") or settings.get("model"))


# The model-based filters of `prepare` (glm46.data.staged), in the order they run, and when each is on
FILTERS = {
    "perplexity": _model_given,  # a reference to fit its n-gram model on, or a model
    "quality_classifier": _model_given,  # a reference to train the classifier on, or a model
    "toxicity": lambda settings: settings.get("max") is not None,
    "semantic_dedup": lambda settings: settings.get("threshold") is not None,
}


def filter_on(name: str, settings: dict | None) -> bool:
    """Whether prepare.<name> (one of FILTERS) asks for its filter."""
    return bool(settings) and FILTERS[name](settings)


def prepare_fingerprint(source: dict, settings: dict) -> str:
    """The fingerprint of preparing `source` (a `source=embedded|jsonl|...` node) with `settings` (`prepare`)."""
    # reference_domains acts through the filters' settings (theirs, resolved from it, are in `settings` when on)
    source = {k: v for k, v in source.items() if k not in ("output_dir", "reference_domains")}
    for key, default in SOURCE_KEYS.items():  # at its default: the fingerprint of a source from before the field
        if source.get(key, default) in (None, default):
            source.pop(key, None)
    settings = {k: v for k, v in settings.items() if k not in ("num_workers", "tasks", "dry", "estimate")}
    if not settings.get("keep_excluded"):  # off: the fingerprint of a preparation from before the setting
        settings.pop("keep_excluded", None)
    for name in FILTERS:  # off: the fingerprint of a preparation from before the filter
        if not filter_on(name, settings.get(name)):
            settings.pop(name, None)
    key = {
        "source": source,
        "prepare": settings,
        "files": source_signature(source["reader"], list(source.get("paths") or [])),
    }
    return hashlib.blake2b(json.dumps(key, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


def _shards_fingerprint(output_dir: Path) -> str | None:
    index = output_dir / "tokens" / "shards.json"
    return json.loads(index.read_text())["fingerprint"] if index.is_file() else None


def is_prepared(output_dir: str | Path, fingerprint: str) -> bool:
    """Whether `output_dir` holds the output of the preparation with this fingerprint, untouched since."""
    record = Path(output_dir) / RECORD
    if not record.is_file():
        return False
    saved = json.loads(record.read_text())
    return saved.get("fingerprint") == fingerprint and saved.get("shards") == _shards_fingerprint(Path(output_dir))


def mark_prepared(output_dir: str | Path, fingerprint: str) -> None:
    output_dir = Path(output_dir)
    record = {"fingerprint": fingerprint, "shards": _shards_fingerprint(output_dir)}
    (output_dir / RECORD).write_text(json.dumps(record, indent=2))
