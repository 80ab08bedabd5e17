"""The whole preparation, from sources to a dataset a DataModule reads: read -> normalise, deduplicate,
filter -> train or load a tokenizer -> token shards. One task is the staged preparation (glm46.data.staged)
run in this process, stage after stage: the same code, and so the same output, as over N tasks.

`prepare_dataset(...)` is `python run.py task=prepare` without Hydra:

    from glm46.data.pipeline import prepare_dataset
    from glm46.data.quality import QualityRules
    prepare_dataset("jsonl", ["docs/"], "out/", quality=QualityRules())
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from glm46.errors import ConfigError

from .cache import RECORD
from .prepare import READERS
from .quality import QualityRules
from .shards import load_tokenizer
from .staged.executors import run_local
from .staged.filter_checks import check_filters
from .staged.work import WORK, plan_for

log = logging.getLogger(__name__)

# What a `dedup` argument leaves out (conf/prepare/default.yaml's values): every stage on, MinHash over word 5-grams
DEDUP_DEFAULTS = {
    "exact": True,
    "url": True,
    "near": True,
    "threshold": 0.8,
    "num_perm": 128,
    "shingle_size": 5,
    "seed": 1,
}


def prepare_dataset(
    reader: str,
    paths: list[str],
    output_dir: str | Path,
    *,
    default_domain: str = "general",
    options: dict | None = None,
    text_key: str = "text",
    id_key: str = "id",
    split: str | None = None,
    dedup: dict | None = None,
    quality: QualityRules | None = None,
    tokenizer_path: str | None = None,
    vocab_size: int = 8192,
    max_digits: int = 3,
    num_workers: int = 2,
    keep_excluded: bool = False,
    perplexity: dict | None = None,
    quality_classifier: dict | None = None,
    toxicity: dict | None = None,
    semantic_dedup: dict | None = None,
) -> dict:
    """Write `output_dir`: documents/, manifest.json, tokenizer.json, tokens/ and prepared.json; return the
    manifest. Whatever `output_dir` held before is replaced.

    reader: one of READERS (embedded, jsonl, chat, text, parquet, preference, hf); text_key, id_key: the fields of
    a record's text and id (readers jsonl, parquet, hf); split: the split reader hf reads (None: train); dedup: the
    stages' switches and MinHash settings (missing keys: DEDUP_DEFAULTS); tokenizer_path: a tokenizer.json to use
    as is (checked before any document is read), else a byte-level BPE of `vocab_size` whose tokens hold at most
    `max_digits` digits is trained on the kept documents; num_workers: threads for MinHash and tokenization;
    keep_excluded: every dropped input written to `output_dir/excluded/<reason>.jsonl` (glm46.data.staged.excluded);
    perplexity, quality_classifier, toxicity, semantic_dedup: the model-based filters, each with the keys of its
    node in conf/prepare/default.yaml (the modules of glm46.data.staged: perplexity, classifier, toxicity, semantic;
    None: off)."""
    source = {
        "reader": reader,
        "paths": list(paths),
        "output_dir": str(output_dir),
        "default_domain": default_domain,
        "options": options or {},
        "text_key": text_key,
        "id_key": id_key,
        "split": split,
    }
    settings = {
        "tasks": 1,
        "dedup": DEDUP_DEFAULTS | (dedup or {}),
        "quality": vars(quality or QualityRules()),
        "tokenizer": {"path": tokenizer_path, "vocab_size": vocab_size, "max_digits": max_digits},
        "num_workers": num_workers,
        "keep_excluded": keep_excluded,
        "perplexity": perplexity,
        "quality_classifier": quality_classifier,
        "toxicity": toxicity,
        "semantic_dedup": semantic_dedup,
    }
    return run_preparation(source, settings)


def run_preparation(source: dict, settings: dict) -> dict:
    """Prepare `source` (a `source=` node) with `settings` (the `prepare` node) on this machine: one task in this
    process (whatever `source.output_dir` held is replaced), or prepare.tasks tasks as processes of their own,
    prepare.num_workers at a time (an unfinished run of the same preparation resumes). Returns the manifest."""
    if source["reader"] not in READERS:
        raise ConfigError(
            f"source.reader={source['reader']!r}: task=prepare reads one of {sorted(READERS)} "
            f"(source=embedded, jsonl, chat, text, parquet, preference or hf)"
        )
    if settings["tokenizer"]["path"]:
        load_tokenizer(settings["tokenizer"]["path"])  # before any document is read
    check_filters(settings)
    output_dir, inline = Path(source["output_dir"]), settings["tasks"] == 1
    if inline:  # one task starts afresh, as one process always has
        shutil.rmtree(output_dir / WORK, ignore_errors=True)
        (output_dir / RECORD).unlink(missing_ok=True)
    plan = plan_for(source, settings, threads=settings["num_workers"] if inline else 1)
    plan.save()
    run_local(plan, workers=1 if inline else settings["num_workers"])
    if inline:
        shutil.rmtree(plan.work)
    manifest = json.loads((output_dir / "manifest.json").read_text())
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(manifest["dropped"].items())) or "none"
    log.info(f"{manifest['documents_in']} documents in, {manifest['documents_out']} out; dropped: {dropped}")
    log.info(f"wrote {output_dir}/manifest.json, tokenizer.json, tokens/")
    return manifest
