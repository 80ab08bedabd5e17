"""The whole preparation, from sources to a dataset a DataModule reads: read -> normalise, deduplicate,
filter (glm46.data.prepare) -> train or load a tokenizer -> token shards (glm46.data.shards).

`prepare_dataset(...)` is `python run.py task=prepare` without Hydra:

    from glm46.data.pipeline import prepare_dataset
    from glm46.data.quality import QualityRules
    prepare_dataset("jsonl", ["docs/"], "out/", quality=QualityRules())
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

from glm46.errors import ConfigError

from .documents import Ledger
from .prepare import READERS, prepare
from .quality import QualityRules
from .shards import EOS, write_shards
from .tokenizer import GLMTokenizer, train_tokenizer

log = logging.getLogger(__name__)


def load_tokenizer(path: str | Path) -> GLMTokenizer:
    """The tokenizer.json at `path` (prepare.tokenizer.path), which must have the document-end token."""
    tokenizer = GLMTokenizer.from_file(path)
    if tokenizer.tokenizer.token_to_id(EOS) is None:
        raise ConfigError(
            f"prepare.tokenizer.path={path}: the tokenizer has no {EOS!r} token, which "
            f"ends every document in the token shards"
        )
    return tokenizer


def _texts(documents_dir: Path) -> Iterator[str]:
    for file in sorted(documents_dir.glob("*.jsonl")):
        with open(file) as f:
            for line in f:
                yield json.loads(line)["text"]


def prepare_dataset(
    reader: str,
    paths: list[str],
    output_dir: str | Path,
    *,
    default_domain: str = "general",
    options: dict | None = None,
    dedup: dict | None = None,
    quality: QualityRules | None = None,
    tokenizer_path: str | None = None,
    vocab_size: int = 8192,
    num_workers: int = 2,
) -> dict:
    """Write `output_dir`: documents/, manifest.json, tokenizer.json and tokens/; return the manifest.

    reader: one of READERS (embedded, jsonl, text, parquet); dedup: glm46.data.prepare.prepare's switches and
    MinHash settings (conf/prepare/default.yaml; missing keys: on, with dedup_near's defaults); tokenizer_path:
    a tokenizer.json to use as is (checked before any document is read), else a byte-level BPE of `vocab_size`
    is trained on the kept documents."""
    if reader not in READERS:
        raise ConfigError(
            f"source.reader={reader!r}: task=prepare reads one of {sorted(READERS)} "
            f"(source=embedded, jsonl, text or parquet)"
        )
    own_tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
    ledger = Ledger()
    documents = READERS[reader](list(paths), ledger, default_domain, **(options or {}))
    manifest = prepare(documents, ledger, output_dir, dedup or {}, quality or QualityRules(), num_workers)
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(manifest["dropped"].items())) or "none"
    log.info(f"{manifest['documents_in']} documents in, {manifest['documents_out']} out; dropped: {dropped}")

    output_dir = Path(output_dir)
    tokenizer = own_tokenizer or GLMTokenizer(train_tokenizer(_texts(output_dir / "documents"), vocab_size))
    tokenizer.save(output_dir / "tokenizer.json")
    shards = write_shards(output_dir, tokenizer, num_threads=num_workers)
    tokens = sum(d["tokens"] for d in shards["domains"].values())
    log.info(f"{tokens:,} tokens ({tokenizer.vocab_size} vocabulary), fingerprint {shards['fingerprint']}")
    log.info(f"wrote {output_dir}/manifest.json, tokenizer.json, tokens/")
    return manifest
