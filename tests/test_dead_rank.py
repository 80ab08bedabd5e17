"""A rank that dies mid-run (SIGKILL: no handler, nothing flushed) ends the whole 2-process job within seconds
instead of leaving the other rank blocked in a collective, and `ckpt_path=last` then finishes the run to the
same final weights as a run that was never interrupted (DDP on gloo, through `python run.py`). The same on the
local Slurm: tests/test_local_slurm.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from glm46.lit.strategies import build_strategy
from glm46.planning.sizing import composed_layout

from .helpers import launcher_env

ROOT = Path(__file__).resolve().parents[1]
# 2 ranks x 2 sequences per step, 6 steps, a checkpoint every 2 steps.
RUN = [
    "experiment=tiny_bytes",
    "parallelism=ddp",
    "cluster.devices=2",
    "data.max_bytes=100000",
    "data.seq_len=32",
    "data.batch_size=2",
    "trainer.max_steps=6",
    "trainer.val_check_interval=1000",
    "trainer.limit_val_batches=0",
    "callbacks.progress_bar=null",
    "callbacks.throughput=null",
    "callbacks.model_checkpoint.every_n_train_steps=2",
]
KILLED_AT, RESUMED_FROM = 3, 2  # the kill comes during step 4; the newest checkpoint is step 2's
ENDS_WITHIN_S = 60  # Lightning's launcher polls its children every 5 s; a hang would last parallelism.timeout_s


class KillRankAtStep(L.Callback):
    """SIGKILL global rank `rank` as it starts the step after `step` optimizer steps, once per run: the time of
    the kill goes to `marker` first, so the resumed (or requeued) run is left alone and the test can time the
    job's end."""

    def __init__(self, rank: int, step: int, marker: str):
        self.rank, self.step, self.marker = rank, step, Path(marker)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step and not self.marker.exists():
            self.marker.write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


def kill(rank: int, marker: str) -> list[str]:
    return [
        f"+callbacks.kill._target_={__name__}.KillRankAtStep",
        f"+callbacks.kill.rank={rank}",
        f"+callbacks.kill.step={KILLED_AT}",
        f"+callbacks.kill.marker={marker}",
    ]


def killed_at(marker: Path) -> float:
    """When the kill came (time.time())."""
    return float(marker.read_text())


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "hf" / "model.safetensors")


def assert_same_weights(resumed: Path, straight: Path) -> None:
    a, b = final_weights(resumed), final_weights(straight)
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ after the resume: {different[:5]}"


def group_alive(group: int) -> list[int]:
    """Live (not zombie) processes of process group `group`: the job's ranks, all started in one session."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] not in "ZX":
            alive.append(int(stat.parent.name))
    return alive


def run(run_dir: Path, *overrides: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    """`python run.py` in a session of its own; returns when every process of that session has ended, with the
    time it did. Lightning's launcher starts the other rank as a child, in the same process group."""
    env = launcher_env()
    process = subprocess.Popen(
        [sys.executable, "run.py", *RUN, f"hydra.run.dir={run_dir}", *overrides],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        deadline = time.monotonic() + 30
        while group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        ended = time.time()
        assert not group_alive(process.pid), f"ranks left running: {group_alive(process.pid)}"
    finally:
        for pid in group_alive(process.pid):
            os.kill(pid, signal.SIGKILL)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), ended


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight")
    result, _ = run(run_dir)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("rank", [1, 0])
def test_a_killed_rank_ends_the_job_within_seconds_and_it_resumes_to_the_same_weights(straight, tmp_path, rank):
    marker = tmp_path / "killed"
    killed, ended = run(tmp_path, *kill(rank, str(marker)))
    took = ended - killed_at(marker)
    print(f"rank {rank} killed: the job ended {took:.1f} s later (exit {killed.returncode})")
    assert killed.returncode != 0, killed.stdout[-2000:] + killed.stderr[-3000:]
    assert took < ENDS_WITHIN_S
    assert not (tmp_path / "hf").exists()
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == RESUMED_FROM
    resumed, _ = run(tmp_path, *kill(rank, str(marker)), "ckpt_path=last")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert_same_weights(tmp_path, straight)


@pytest.mark.parametrize("layout", ["ddp", "fsdp2", "ep", "deepspeed_zero3"])
@pytest.mark.parametrize("overrides, seconds", [([], 600), (["parallelism.timeout_s=45"], 45)])
def test_the_strategy_carries_parallelism_timeout_s(compose_config, layout, overrides, seconds):
    cfg = compose_config("experiment=tiny_bytes", f"parallelism={layout}", "cluster.devices=2", *overrides)
    strategy = build_strategy(cfg.parallelism, composed_layout(cfg))
    assert strategy._timeout == timedelta(seconds=seconds)
