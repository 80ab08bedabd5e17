"""What a preparation will take before it runs (`task=prepare prepare.dry=true`): wall time over its tasks and the
storage of its inputs, its work folder and its output, from the corpus size and the rates `bench/prepare_scale.py`
measures (the defaults are this project's 2-core machine: measure yours and set prepare.estimate.*)."""

from __future__ import annotations

from pathlib import Path

from ..cache import FILTERS, filter_on
from ..dedup import lsh_bands
from ..embedded import source_files
from ..prepare import input_files, reader_options


def input_bytes(source: dict) -> int:
    """Bytes of the files the source reads (for the embedded corpus: the files it generates its documents from)."""
    if source["reader"] == "embedded":
        files = source_files()
    else:
        files = input_files(source["reader"], list(source["paths"]), reader_options(source))
    return sum(_size(Path(f)) for f in files)


def _size(path: Path) -> int:
    """A file's bytes, or those of every file under a folder (a `datasets` folder written by save_to_disk)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def estimate(source: dict, settings: dict, threads: int = 1) -> dict:
    """Tokens, documents, hours and bytes (work folder at its largest, output) of preparing `source` with
    `settings` (the prepare node) over settings["tasks"] tasks of `threads` CPUs."""
    rates, dedup, tasks = settings["estimate"], settings["dedup"], int(settings["tasks"])
    read = input_bytes(source)
    tokens = float(rates["corpus_tokens"] or read / rates["bytes_per_token"])
    documents = tokens / rates["tokens_per_document"]
    text = tokens * rates["bytes_per_token"]
    parallel = tokens * rates["task_seconds_per_token"] / (tasks * threads)
    serial = documents * rates["clusters_seconds_per_document"] if dedup.get("near", True) else 0.0
    on = [name for name in FILTERS if filter_on(name, settings.get(name))]
    filtering = sum(documents * rates["filter_seconds_per_document"][name] for name in on) / (tasks * threads)
    if "semantic_dedup" in on:  # its one task embeds the sample k-means is fitted on
        sample = min(documents, settings["semantic_dedup"]["fit_sample"])
        filtering += sample * rates["filter_seconds_per_document"]["semantic_dedup"] / threads
    bands = len(lsh_bands(dedup["threshold"], dedup["num_perm"])) if dedup.get("near", True) else 0
    per_document = 24 + 16 + 16 + (4 * dedup["num_perm"] + 20 * bands if dedup.get("near", True) else 0)
    token_bytes = 2 if settings["tokenizer"]["vocab_size"] <= 1 << 16 and not settings["tokenizer"]["path"] else 4
    output = text + tokens * token_bytes + 8 * documents
    return {
        "input_bytes": read,
        "tokens": tokens,
        "documents": documents,
        "hours": (parallel + serial + filtering) / 3600,
        "one_task_hours": serial / 3600,
        "filter_hours": filtering / 3600,
        "work_bytes": text + documents * per_document + tokens * token_bytes,  # before finish removes it
        "output_bytes": output,
    }


def format_estimate(result: dict, tasks: int, threads: int) -> str:
    return (
        f"preparation estimate over {tasks} task(s) of {threads} CPU(s) (prepare.estimate.*):\n"
        f"  corpus     {result['tokens']:.3g} tokens, {result['documents']:.3g} documents "
        f"({result['input_bytes'] / 1e9:,.2f} GB of input files)\n"
        f"  time       {result['hours']:,.2f} h, of which {result['one_task_hours']:,.2f} h in the one-task stages"
        + (f", {result['filter_hours']:,.2f} h in the model-based filters" if result["filter_hours"] else "")
        + "\n"
        f"  storage    work folder up to {result['work_bytes'] / 1e12:,.3f} TB, "
        f"output {result['output_bytes'] / 1e12:,.3f} TB"
    )
