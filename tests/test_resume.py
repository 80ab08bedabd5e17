"""Bitwise-exact resume: a run killed with SIGKILL (no handler, no flush) and resumed with `ckpt_path=last`
in the same run directory logs the same losses after the resume point and ends with the same weights, bit
for bit, as the run that was never interrupted. Kill points: inside a gradient-accumulation cycle, right
after a checkpoint, and in the first stage of a two-stage curriculum (the resume crosses the phase boundary).
"""

import csv
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .helpers import SHORT_RUN, UNKILLED, kill_at, run_py

# 6 optimizer steps of 2 micro-batches, a checkpoint every 2 steps, every step logged.
RUN = [*SHORT_RUN, "trainer.max_steps=6", "trainer.accumulate_grad_batches=2"]
STAGES = ['+stages.first=["optim.lr=0.001"]']  # a first stage at another learning rate


def run(run_dir: Path, *overrides: str, killed: bool = False) -> subprocess.CompletedProcess:
    return run_py(*RUN, f"hydra.run.dir={run_dir}", *overrides, killed=killed)


def losses(run_dir: Path) -> dict[int, str]:
    """step -> train/loss as written (the last row per step: a resumed run appends the steps it repeats)."""
    with open(run_dir / "metrics.csv") as f:
        return {int(row["step"]): row["train/loss"] for row in csv.DictReader(f) if row.get("train/loss")}


def assert_same_run(resumed: Path, straight: Path, after_step: int) -> None:
    a, b = load_file(resumed / "hf" / "model.safetensors"), load_file(straight / "hf" / "model.safetensors")
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ after the resume: {different[:5]}"
    expected = {step: loss for step, loss in losses(straight).items() if step >= after_step}
    got = {step: loss for step, loss in losses(resumed).items() if step >= after_step}
    assert got == expected and len(expected) >= 2


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    run(run_dir)
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    "batch, resumed_from",
    [
        (5, 2),  # the second micro-batch of step 3: its first micro-batch's gradient is lost with the process
        (8, 4),  # the first micro-batch after the checkpoint of step 4
    ],
)
def test_sigkill_then_resume_is_bitwise_the_straight_run(straight, tmp_path, batch, resumed_from):
    run(tmp_path, *kill_at(batch), killed=True)
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == resumed_from
    assert not (tmp_path / "hf").exists()
    run(tmp_path, "ckpt_path=last", *UNKILLED)
    assert_same_run(tmp_path, straight, after_step=resumed_from)


@pytest.mark.slow
def test_a_curriculum_killed_in_its_first_stage_resumes_across_the_phase_boundary(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run(straight, *STAGES)
    run(killed, *STAGES, *kill_at(5), killed=True)
    assert not (killed / "stages" / "first" / "hf").exists()
    resumed = run(killed, *STAGES, "ckpt_path=last", *UNKILLED)
    assert "stage first:" in resumed.stdout
    assert_same_run(killed / "stages" / "first", straight / "stages" / "first", after_step=2)
    assert_same_run(killed, straight, after_step=0)


@pytest.mark.slow
def test_a_truncated_last_checkpoint_is_skipped_for_the_newest_valid_one(straight, tmp_path):
    run(tmp_path, *kill_at(8), killed=True)
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # as a disk that filled up would leave it
    resumed = run(tmp_path, "ckpt_path=last", *UNKILLED)
    assert f"skipping {last}: not a readable checkpoint" in resumed.stdout + resumed.stderr
    assert_same_run(tmp_path, straight, after_step=4)  # from step0000004.ckpt, the same step
