"""SIGTERM (or Slurm's SIGUSR1 warning) mid-step: the run saves at the next step boundary, stops cleanly
without exporting, and `ckpt_path=last` continues it to the end; a second signal during the save changes
nothing. (Bitwise equality of a resumed run with an uninterrupted one: tests/test_resume.py.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import forked

ROOT = Path(__file__).resolve().parents[1]
RUN = [
    "experiment=tiny_bytes",
    "data.max_bytes=200000",
    "data.seq_len=64",
    "data.batch_size=4",
    "trainer.max_steps=8",
    "trainer.val_check_interval=1000",
    "trainer.limit_val_batches=0",
    "logger=csv",
    "callbacks.model_checkpoint.every_n_train_steps=1000",
]


def run(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    result = forked.run(
        [sys.executable, "run.py", *RUN, f"hydra.run.dir={run_dir}", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def checkpoint(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("signal", ["SIGTERM", "SIGUSR1"])
def test_signal_saves_at_the_step_boundary_and_the_run_resumes_to_the_end(tmp_path, signal):
    interrupted = tmp_path / "interrupted"
    first = run(
        interrupted,
        "+callbacks.signal._target_=tests.helpers.SignalAtStep",
        "+callbacks.signal.step=3",
        f"+callbacks.signal.signal={signal}",
    )
    assert "interrupted at step 4" in first.stdout  # the step in flight finished, then the save
    assert checkpoint(interrupted)["global_step"] == 4
    assert not (interrupted / "hf").exists()  # an interrupted run does not export
    state = json.loads((interrupted / "state.json").read_text())  # what glm46.compare reads
    assert state["state"] == "interrupted"
    second = run(interrupted, "ckpt_path=last")
    assert "interrupted at step" not in second.stdout
    assert checkpoint(interrupted)["global_step"] == 8
    assert (interrupted / "hf" / "config.json").is_file()
    assert json.loads((interrupted / "state.json").read_text())["state"] == "completed"


@pytest.mark.slow
def test_a_second_signal_during_the_save_changes_nothing(tmp_path):
    result = run(
        tmp_path,
        "+callbacks.signal._target_=tests.helpers.SignalAtStep",
        "+callbacks.signal.step=3",
        "+callbacks.again._target_=tests.helpers.SignalDuringSave",
    )
    assert "interrupted at step 4" in result.stdout
    assert checkpoint(tmp_path)["global_step"] == 4  # the one save, complete
    assert not list((tmp_path / "checkpoints").glob("*.partial"))
