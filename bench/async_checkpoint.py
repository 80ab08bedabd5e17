"""What a checkpoint save costs the training steps: FSDP2 on 2 gloo processes (`python run.py`), a checkpoint every
`--every` steps, synchronous DCP saves (the peer: Lightning's ModelParallelStrategy) against
`parallelism.async_checkpoint=true` (staged to host memory, written by a background thread). Rank 0 records each
step's wall time; the stall of a save is the mean time of the steps that saved minus the median of the others.

    python bench/async_checkpoint.py --hidden 512 --layers 8 --steps 24 --every 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]


class StepTimes(L.Callback):
    """Rank 0 appends each optimizer step's wall time to `path`, and whether a checkpoint was saved in it."""

    def __init__(self, path: str):
        self.path, self.started, self.saved = Path(path), None, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.started, self.saved = time.perf_counter(), False

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.saved = True

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        # the checkpoint callback saves in its own on_train_batch_end, which runs after this one: time the next start
        if trainer.is_global_zero:
            with open(self.path, "a") as f:
                f.write(
                    json.dumps({"step": trainer.global_step, "start": self.started, "end": time.perf_counter()}) + "\n"
                )


def run(folder: Path, args, asynchronous: bool) -> list[dict]:
    record = folder / "steps.jsonl"
    overrides = [
        "experiment=tiny_bytes",
        "parallelism=fsdp2",
        "cluster.devices=2",
        f"model.hidden_size={args.hidden}",
        f"model.intermediate_size={args.hidden * 5 // 2}",
        f"model.num_hidden_layers={args.layers}",
        "data.max_bytes=400000",
        "data.seq_len=64",
        "data.batch_size=2",
        f"trainer.max_steps={args.steps}",
        "trainer.limit_val_batches=0",
        "callbacks.progress_bar=null",
        f"callbacks.model_checkpoint.every_n_train_steps={args.every}",
        "callbacks.model_checkpoint.save_top_k=-1",
        f"parallelism.async_checkpoint={str(asynchronous).lower()}",
        f"hydra.run.dir={folder / 'run'}",
        "+callbacks.steps._target_=async_checkpoint.StepTimes",
        f"+callbacks.steps.path={record}",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = f"{ROOT / 'bench'}:{ROOT}"
    result = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *overrides], cwd=folder, env=env, capture_output=True, text=True
    )
    if result.returncode:
        sys.exit(result.stdout[-2000:] + result.stderr[-3000:])
    steps = [json.loads(line) for line in record.read_text().splitlines()]
    for step, following in zip(steps, steps[1:]):
        step["wall"] = following["start"] - step["start"]  # to the next step's start: the save included
    return steps[:-1]


def stall(steps: list[dict], every: int) -> tuple[float, float]:
    """(median seconds of a step without a save, mean extra seconds of a step that saved)."""
    saving = [s["wall"] for s in steps if s["step"] % every == 0]
    others = [s["wall"] for s in steps if s["step"] % every and s["step"] > 2]
    base = statistics.median(others)
    return base, statistics.mean(saving) - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    args = parser.parse_args()
    results = {}
    for asynchronous in (False, True):
        with tempfile.TemporaryDirectory() as folder:
            results[asynchronous] = stall(run(Path(folder), args, asynchronous), args.every)
            size = sum(f.stat().st_size for f in Path(folder, "run", "checkpoints").rglob("*.distcp"))
        name = "async (background thread)" if asynchronous else "synchronous DCP (peer)"
        base, extra = results[asynchronous]
        shards = f"{size / 1e6:.0f} MB of shards"
        print(f"{name:<28} step {base * 1e3:7.1f} ms, a step that saves +{extra * 1e3:7.1f} ms ({shards})")
    print(f"the save's stall, async / sync: {results[True][1] / results[False][1]:.2f}")


if __name__ == "__main__":
    main()
