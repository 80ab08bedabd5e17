"""Staged preparation (glm46.data.staged) over 1, 2 and 4 tasks against `prepare.tasks=1` run in this process (the
peer: the same stages one after another, what `prepare_dataset` and `task=prepare` without tasks do),
on a generated JSONL corpus (a tenth near-duplicates of earlier documents, some exact copies) in `--files`
files: documents/s, the ratio to the peer, each stage's share of the tasks' time, and the wall time
extrapolated to a corpus of `--target-tokens` on `--nodes` CPU nodes of `--cores` cores.

On Slurm (the local one of scripts/local_slurm.sh when it answers) each stage is a job array of one-CPU tasks,
so on 2 cores the ceiling is 2x; without Slurm the local executor runs 2 tasks at a time. Each staged result is
checked equal to the peer's (manifest counts and token fingerprint) before its time is reported. Every timed run
is given a tokenizer trained once beforehand (as a GLM run is given GLM's).

    python bench/prepare_scale.py --docs 60000 --files 8
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from glm46.data.cache import prepare_fingerprint  # noqa: E402
from glm46.data.pipeline import prepare_dataset  # noqa: E402
from glm46.data.quality import QualityRules  # noqa: E402
from glm46.data.staged.executors import run_local, submit_slurm, wait_slurm  # noqa: E402
from glm46.data.staged.work import SINGLE, StagedPlan, make_plan  # noqa: E402

DEDUP = {"exact": True, "url": True, "near": True, "threshold": 0.8, "num_perm": 128, "shingle_size": 5, "seed": 1}
COMPARED = ("documents_in", "documents_out", "dropped", "bytes_out", "domains")


def write_corpus(folder: Path, docs: int, files: int, seed: int = 0) -> None:
    """Prose-like documents of 100-400 words over 5,000 words; 10% near-copies (3 words changed) and 2% exact
    copies of an earlier document, anywhere in the corpus (so across files)."""
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 8))) for _ in range(5000)]
    texts = []
    for _ in range(docs):
        draw = rng.random()
        if texts and draw < 0.10:
            copy = rng.choice(texts).split()
            for _ in range(3):
                copy[rng.randrange(len(copy))] = rng.choice(vocabulary)
            texts.append(" ".join(copy))
        elif texts and draw < 0.12:
            texts.append(rng.choice(texts))
        else:
            texts.append(" ".join(rng.choices(vocabulary, k=rng.randint(100, 400))) + ".")
    folder.mkdir(parents=True)
    per_file = -(-docs // files)
    for f in range(files):
        with open(folder / f"part-{f:03d}.jsonl", "w") as out:
            out.writelines(json.dumps({"text": t}) + "\n" for t in texts[f * per_file : (f + 1) * per_file])


def slurm_answers() -> bool:
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_staged(corpus: Path, output: Path, tasks: int, tokenizer: Path, slurm: bool) -> tuple[StagedPlan, float]:
    source = {"reader": "jsonl", "paths": [str(corpus)], "output_dir": str(output), "default_domain": "general"}
    settings = {
        "tasks": tasks,
        "dedup": DEDUP,
        "quality": vars(QualityRules()),
        "tokenizer": {"path": str(tokenizer), "vocab_size": 0},
    }
    plan = make_plan(source, settings, prepare_fingerprint(source, settings), threads=1)
    plan.save()
    start = time.perf_counter()
    if slurm:
        import submitit

        executor = submitit.AutoExecutor(folder=plan.work / "slurm" / "%j", cluster="slurm")
        executor.update_parameters(slurm_partition="debug", cpus_per_task=1, timeout_min=60, nodes=1, tasks_per_node=1)
        wait_slurm(plan, submit_slurm(plan, executor, {}))
    else:
        run_local(plan, workers=2)
    return plan, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=60000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--tasks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--target-tokens", type=float, default=23e12)
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--cores", type=int, default=64, help="cores per CPU node (one task per core)")
    args = parser.parse_args()
    slurm = slurm_answers()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        write_corpus(corpus, args.docs, args.files)
        prepare_dataset("jsonl", [str(corpus)], Path(tmp) / "bpe", dedup=DEDUP, vocab_size=args.vocab)
        tokenizer = Path(tmp) / "bpe" / "tokenizer.json"  # given to every timed run, as a GLM run is given GLM's
        start = time.perf_counter()
        peer = prepare_dataset("jsonl", [str(corpus)], Path(tmp) / "one", dedup=DEDUP, tokenizer_path=str(tokenizer))
        one_seconds = time.perf_counter() - start
        shards = json.loads((Path(tmp) / "one" / "tokens" / "shards.json").read_text())
        tokens = sum(d["tokens"] for d in shards["domains"].values())
        print(
            f"corpus: {args.docs:,} documents in {args.files} files, {tokens:,} tokens kept; executor: "
            f"{'Slurm job arrays (1 CPU per task)' if slurm else 'local processes, 2 at a time'}"
        )
        print(f"in this process (2 threads): {one_seconds:.1f} s, {args.docs / one_seconds:,.0f} documents/s")
        print(
            f"{'tasks':>5} {'wall s':>8} {'slowest tasks s':>16} {'documents/s':>12} {'vs in-process':>15}   "
            "share of task time per stage"
        )
        measured = {}
        for tasks in args.tasks:
            plan, seconds = run_staged(corpus, Path(tmp) / f"staged{tasks}", tasks, tokenizer, slurm)
            manifest = json.loads((Path(plan.output_dir) / "manifest.json").read_text())
            ours = json.loads((Path(plan.output_dir) / "tokens" / "shards.json").read_text())["fingerprint"]
            assert all(manifest[k] == peer[k] for k in COMPARED) and ours == shards["fingerprint"], "not equal"
            stats = {s: [plan.stats(s, i) for i in range(plan.size(s))] for s in plan.stages}
            per_stage = {s: sum(t["seconds"] for t in tasks_) for s, tasks_ in stats.items()}
            slowest = sum(max(t["seconds"] for t in tasks_) for tasks_ in stats.values())
            total = sum(per_stage.values())
            shares = " ".join(f"{s} {100 * t / total:.0f}%" for s, t in per_stage.items())
            print(
                f"{tasks:>5} {seconds:>8.1f} {slowest:>16.1f} {args.docs / seconds:>12,.0f} "
                f"{one_seconds / seconds:>14.2f}x   {shares}"
            )
            measured[tasks] = stats
            shutil.rmtree(plan.output_dir)
        extrapolate(measured[max(measured)], tokens, args)


def extrapolate(stats: dict[str, list[dict]], tokens: int, args) -> None:
    """The parallel stages' task-seconds per kept token spread over every core; `clusters` (one task) grown with the
    LSH edges it joins (a fixed share of the documents); `tokenizer` (given) and `finish` (the counts, the pieces
    that straddle two parts) stay at their measured seconds, as they grow with the tasks, not the corpus."""
    seconds = {s: sum(t["seconds"] for t in tasks_) for s, tasks_ in stats.items()}
    parallel = sum(t for s, t in seconds.items() if s not in SINGLE) / tokens
    scale = args.target_tokens / tokens
    serial = seconds.get("clusters", 0.0) * scale + seconds["tokenizer"] + seconds["finish"]
    in_buckets = stats["clusters"][0]["documents"] if "clusters" in stats else 0
    print(
        f"\nextrapolated to {args.target_tokens:.3g} tokens ({scale:,.0f}x this corpus): parallel stages "
        f"{parallel:.3g} task-seconds per token; one-task stages {serial / 3600:,.1f} h (clusters "
        f"{seconds.get('clusters', 0.0):.2f} s here for {in_buckets:,} "
        f"documents in LSH buckets, x{scale:,.0f})"
    )
    for nodes in args.nodes:
        hours = parallel * args.target_tokens / (nodes * args.cores) / 3600 + serial / 3600
        print(f"  {nodes:>5} nodes x {args.cores} cores: {hours:,.1f} h ({hours / 24:,.2f} days)")


if __name__ == "__main__":
    main()
