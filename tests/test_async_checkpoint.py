"""parallelism.async_checkpoint (FSDP2 on 2 gloo processes): checkpoints written in the background resume to the
weights of a run never interrupted; a rank killed while a save may be in flight leaves the previous checkpoint the
one a resume takes; a full disk ends the run naming the checkpoint, the previous one kept. A full disk in the file
save of one process likewise."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glm46.checkpoint.atomic import AtomicCheckpointIO
from glm46.checkpoint.write_errors import CheckpointWriteError

from . import forked
from . import test_dead_rank as dead_rank
from .helpers import launcher_env

ROOT = Path(__file__).resolve().parents[1]
FSDP2 = [o for o in dead_rank.RUN if not o.startswith("parallelism=")] + ["parallelism=fsdp2"]
ASYNC = ["parallelism.async_checkpoint=true"]


def run(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return forked.run(
        [sys.executable, "run.py", *FSDP2, f"hydra.run.dir={run_dir}", *overrides],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def tmpfs(folder: Path, size: int):
    """A file system of `size` bytes at `folder` (root only), unmounted at the end of the test."""
    folder.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    return folder


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The run never interrupted, with synchronous checkpoints."""
    run_dir = tmp_path_factory.mktemp("straight")
    result = run(run_dir)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.distributed
def test_background_checkpoints_resume_to_the_uninterrupted_weights(straight, tmp_path):
    marker = tmp_path / "killed"
    killed = run(tmp_path / "run", *ASYNC, *dead_rank.kill(1, str(marker)))
    assert killed.returncode != 0
    assert (tmp_path / "run" / "checkpoints" / "step0000002.ckpt" / ".metadata").is_file(), killed.stderr[-3000:]
    resumed = run(tmp_path / "run", *ASYNC, *dead_rank.kill(1, str(marker)), "ckpt_path=last")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "written in the background" in resumed.stdout + resumed.stderr
    dead_rank.assert_same_weights(tmp_path / "run", straight)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_full_disk_ends_the_run_naming_the_checkpoint_and_keeps_the_previous(straight, tmp_path):
    """The checkpoints folder holds step 2's checkpoint and last.ckpt (2 of straight's checkpoint folders and a
    half), not step 4's as well."""
    one = sum(f.stat().st_size for f in (straight / "checkpoints" / "step0000002.ckpt").rglob("*") if f.is_file())
    checkpoints = tmpfs(tmp_path / "run" / "checkpoints", int(2.5 * one) // 4096 * 4096)
    try:
        result = run(tmp_path / "run", *ASYNC)
        assert result.returncode != 0
        output = result.stdout + result.stderr
        assert (
            "CheckpointWriteError: checkpoint " in output
            and "step0000004.ckpt was not written: the disk is full" in output
        )
        assert "the previous checkpoint is kept" in output, output[-3000:]
        assert (checkpoints / "step0000002.ckpt" / ".metadata").is_file()
        assert not (checkpoints / "step0000004.ckpt").exists()
    finally:
        subprocess.run(["umount", str(checkpoints)], check=False)


def test_a_full_disk_in_a_file_save_names_it_and_leaves_no_partial_file(tmp_path):
    folder = tmpfs(tmp_path / "small", 1 << 20)
    try:
        io = AtomicCheckpointIO()
        io.save_checkpoint({"w": torch.zeros(1000)}, folder / "first.ckpt")
        with pytest.raises(CheckpointWriteError, match=r"second\.ckpt was not written: the disk is full \(\d"):
            io.save_checkpoint({"w": torch.zeros(1 << 20)}, folder / "second.ckpt")
        assert sorted(p.name for p in folder.iterdir()) == ["first.ckpt"]
        assert torch.load(folder / "first.ckpt")["w"].shape == (1000,)
    finally:
        subprocess.run(["umount", str(folder)], check=False)
        shutil.rmtree(folder, ignore_errors=True)
