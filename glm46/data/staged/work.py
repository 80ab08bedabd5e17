"""What a staged preparation does, fixed before its first task runs: the input files of each read task, the
settings, the stages; and what refuses to start (nothing is queued then)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from glm46.errors import ConfigError

from ..cache import FILTERS, RECORD, filter_on, prepare_fingerprint
from ..prepare import input_files, reader_options

WORK = ".staged"
# stages of one task; the others: prepare.tasks
SINGLE = {"clusters", "perplexity_model", "quality_model", "semantic_clusters", "tokenizer", "finish"}
KEY_BITS = 40  # a document's key: read task << KEY_BITS | its position among that task's inputs (input order)


# The ledger reason of the documents each dedup stage drops, and each model-based filter
DEDUP_REASONS = {"exact": "exact_duplicate", "url": "url_duplicate", "near": "near_duplicate"}
FILTER_REASONS = {
    "perplexity": "perplexity",
    "quality_classifier": "quality_classifier",
    "toxicity": "toxicity",
    "semantic_dedup": "semantic_duplicate",
}
# Each filter's stages (FILTERS, in glm46.data.cache, says when it is on); the last one drops
FILTER_STAGES = {
    "perplexity": ["perplexity_model", "perplexity"],
    "quality_classifier": ["quality_model", "quality_classifier"],
    "toxicity": ["toxicity"],
    "semantic_dedup": ["semantic_clusters", "embed", "semantic_dedup"],
}
DROP_REASONS = DEDUP_REASONS | FILTER_REASONS
HF_INPUTS = " (source=hf: a folder written by save_to_disk is one input file, a folder in the Hub's layout its files)"


@dataclass
class StagedPlan:
    output_dir: str
    tasks: int
    reader: str
    shards: list[list[str]]  # per read task, its input files; none for the embedded corpus (a slice of its documents)
    default_domain: str
    options: dict  # the reader's keyword arguments (glm46.data.prepare.reader_options)
    dedup: dict
    quality: dict
    tokenizer_path: str | None
    vocab_size: int
    max_digits: int
    fingerprint: str
    threads: int = 1  # per task
    stages: list[str] = field(default_factory=list)
    keep_excluded: bool = False  # every dropped input written to excluded/<reason>.jsonl (glm46.data.staged.excluded)
    perplexity: dict = field(default_factory=dict)  # prepare.perplexity (glm46.data.staged.perplexity); {}: off
    quality_classifier: dict = field(default_factory=dict)  # prepare.quality_classifier (.classifier); {}: off
    toxicity: dict = field(default_factory=dict)  # prepare.toxicity (glm46.data.staged.toxicity); {}: off
    semantic_dedup: dict = field(default_factory=dict)  # prepare.semantic_dedup (.semantic); {}: off

    @property
    def work(self) -> Path:
        return Path(self.output_dir) / WORK

    def size(self, stage: str) -> int:
        return 1 if stage in SINGLE else self.tasks

    def task_dir(self, stage: str, index: int) -> Path:
        return self.work / stage / str(index)

    def done(self, stage: str, index: int) -> bool:
        return (self.task_dir(stage, index) / "stats.json").is_file()

    def pending(self, stage: str) -> list[int]:
        return [i for i in range(self.size(stage)) if not self.done(stage, i)]

    def stats(self, stage: str, index: int) -> dict:
        return json.loads((self.task_dir(stage, index) / "stats.json").read_text())

    def save(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / "plan.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, output_dir: str | Path) -> StagedPlan:
        return cls(**json.loads((Path(output_dir) / WORK / "plan.json").read_text()))


def stage_names(dedup: dict, filters: dict | None = None) -> list[str]:
    """The stages, without those of a switched-off deduplication or filter (`filters`: prepare's nodes by name)."""
    names = ["read"]
    names += ["exact"] if dedup.get("exact", True) else []
    names += ["url"] if dedup.get("url", True) else []
    names += ["bands", "clusters", "near"] if dedup.get("near", True) else []
    for name in FILTERS:
        names += FILTER_STAGES[name] if filter_on(name, (filters or {}).get(name)) else []
    return names + ["tokenizer", "tokenize", "merge", "finish"]


def split_files(files: list[Path], tasks: int) -> list[list[str]]:
    """Contiguous runs of `files` (input order is kept), about equal in bytes, at least one file each."""
    sizes = np.cumsum([f.stat().st_size + 1 for f in files])
    bounds = [0]
    for k in range(1, tasks):
        cut = int(np.argmin(np.abs(sizes - sizes[-1] * k / tasks))) + 1  # the file end nearest k/tasks of the bytes
        bounds.append(min(max(cut, bounds[-1] + 1), len(files) - (tasks - k)))
    bounds.append(len(files))
    return [[str(f) for f in files[a:b]] for a, b in zip(bounds, bounds[1:])]


def make_plan(source: dict, settings: dict, fingerprint: str, threads: int = 1) -> StagedPlan:
    """The plan of preparing `source` with `settings` (the `prepare` node) over settings["tasks"] tasks, or a
    ConfigError naming what cannot run: no input (or input the reader does not read), a source field the reader has
    no use for, more tasks than input files, an output directory that holds another preparation (or this one's work
    over another number of tasks). `threads`: per task."""
    tasks, output_dir = int(settings["tasks"]), Path(source["output_dir"])
    options = reader_options(source)
    shards: list[list[str]] = []
    if source["reader"] != "embedded":
        try:
            files = input_files(source["reader"], list(source["paths"]), options)
        except (FileNotFoundError, ValueError) as error:  # ValueError: a file or folder the reader does not read
            raise ConfigError(str(error)) from None
        if tasks > len(files):
            raise ConfigError(
                f"prepare.tasks={tasks}: source.paths holds {len(files)} input file(s), and each read task takes "
                f"whole files; use at most {len(files)} tasks or split the input"
                + (HF_INPUTS if source["reader"] == "hf" else "")
            )
        shards = split_files(files, tasks)
    _check_output_dir(output_dir, fingerprint, tasks)
    return StagedPlan(
        output_dir=str(output_dir),
        tasks=tasks,
        reader=source["reader"],
        shards=shards,
        default_domain=source.get("default_domain") or "general",
        options=options,
        dedup=dict(settings["dedup"]),
        quality={k: v for k, v in settings["quality"].items() if k != "_target_"},  # QualityRules' fields
        tokenizer_path=settings["tokenizer"]["path"],
        vocab_size=int(settings["tokenizer"]["vocab_size"]),
        max_digits=int(settings["tokenizer"]["max_digits"]),
        fingerprint=fingerprint,
        threads=threads,
        stages=stage_names(settings["dedup"], settings),
        keep_excluded=bool(settings.get("keep_excluded", False)),
        **{name: dict(settings[name]) if filter_on(name, settings.get(name)) else {} for name in FILTERS},
    )


def plan_for(source: dict, settings: dict, threads: int = 1) -> StagedPlan:
    """make_plan under the fingerprint of `source` and `settings` (glm46.data.cache) that marks the preparation."""
    return make_plan(source, settings, prepare_fingerprint(source, settings), threads)


def _check_output_dir(output_dir: Path, fingerprint: str, tasks: int) -> None:
    record, plan = output_dir / RECORD, output_dir / WORK / "plan.json"
    if record.is_file() and json.loads(record.read_text()).get("fingerprint") != fingerprint:
        raise ConfigError(
            f"source.output_dir={output_dir} holds another preparation ({record}): choose another directory, "
            f"or delete it to prepare this one there"
        )
    if plan.is_file():
        earlier = json.loads(plan.read_text())
        if earlier["fingerprint"] != fingerprint or earlier["tasks"] != tasks:
            raise ConfigError(
                f"source.output_dir={output_dir} holds the unfinished work of another staged preparation "
                f"({plan}: {earlier['tasks']} tasks, fingerprint {earlier['fingerprint']}): rerun that one to "
                f"finish it, or delete {output_dir / WORK}"
            )


def write_task(plan: StagedPlan, stage: str, index: int, work) -> dict:
    """Run `work(folder) -> stats` into a temporary folder and rename it when whole: a finished task is exactly
    a folder with stats.json, whatever killed an earlier attempt."""
    final = plan.task_dir(stage, index)
    partial = final.with_name(f"{index}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    stats = work(partial)
    (partial / "stats.json").write_text(json.dumps(stats, indent=2))
    shutil.rmtree(final, ignore_errors=True)  # a finished copy only if two attempts raced: same content
    partial.rename(final)
    return stats


HEADER = f"{'stage':<10} {'tasks':>9} {'documents':>12} {'MB':>10} {'slowest s':>10}"


def stage_row(plan: StagedPlan, stage: str) -> str:
    """A stage's tasks done of all, documents and bytes read or kept, and its slowest task's seconds."""
    done = [plan.stats(stage, i) for i in range(plan.size(stage)) if plan.done(stage, i)]
    documents = sum(s.get("documents", 0) for s in done)
    megabytes = sum(s.get("bytes", 0) for s in done) / 1e6
    slowest = max((s["seconds"] for s in done), default=0.0)
    return f"{stage:<10} {len(done):>4}/{plan.size(stage):<4} {documents:>12,} {megabytes:>10,.1f} {slowest:>10.1f}"


def progress_table(plan: StagedPlan) -> str:
    return "\n".join([HEADER] + [stage_row(plan, stage) for stage in plan.stages])
