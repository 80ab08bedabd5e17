"""Atomic checkpoints: a process killed while writing leaves the previous checkpoint loadable and only a
`.partial` file, which resumes ignore with a warning; a corrupt or truncated checkpoint is named on load, and
`ckpt_path=last` falls back to the newest one that reads. last.ckpt holds the final step of every run."""

import logging
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from glm46.checkpoint.atomic import AtomicCheckpointIO, CorruptCheckpointError, resume_path
from glm46.lit.callbacks import ModelCheckpoint

from .helpers import LinearModule

ROOT = Path(__file__).resolve().parents[1]


def save(path: Path, step: int) -> None:
    AtomicCheckpointIO().save_checkpoint({"global_step": step, "weights": torch.full((1000,), float(step))}, path)


KILLED_WHILE_WRITING = """
import os, signal, sys, torch
from glm46.checkpoint.atomic import AtomicCheckpointIO
path = sys.argv[1]
AtomicCheckpointIO().save_checkpoint({"global_step": 1, "weights": torch.zeros(1000)}, path)
def half_then_die(obj, f):  # the second save: half of the bytes reach the disk, then SIGKILL
    f.write(b"PK" + bytes(1000)); f.flush(); os.kill(os.getpid(), signal.SIGKILL)
torch.save = half_then_die
AtomicCheckpointIO().save_checkpoint({"global_step": 2, "weights": torch.ones(1000)}, path)
"""


def test_a_process_killed_while_saving_leaves_the_previous_checkpoint(tmp_path, caplog):
    last = tmp_path / "last.ckpt"
    result = subprocess.run([sys.executable, "-c", KILLED_WHILE_WRITING, str(last)], cwd=ROOT)
    assert result.returncode == -9
    assert torch.load(last, weights_only=True)["global_step"] == 1
    assert (tmp_path / "last.ckpt.partial").is_file()
    with caplog.at_level(logging.WARNING):
        assert resume_path("last", tmp_path) == str(last)
    assert f"ignoring {tmp_path / 'last.ckpt.partial'}: a checkpoint whose save was interrupted" in caplog.text


def test_last_falls_back_to_the_newest_readable_checkpoint(tmp_path, caplog):
    for step in (2, 4):
        save(tmp_path / f"step{step:07d}.ckpt", step)
    save(tmp_path / "last.ckpt", 4)
    assert resume_path("last", tmp_path) == str(tmp_path / "last.ckpt")
    (tmp_path / "last.ckpt").write_bytes((tmp_path / "last.ckpt").read_bytes()[:-100])  # truncated
    (tmp_path / "step0000004.ckpt").write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.WARNING):
        assert resume_path("last", tmp_path) == str(tmp_path / "step0000002.ckpt")
    assert f"skipping {tmp_path / 'last.ckpt'}: not a readable checkpoint" in caplog.text
    assert f"skipping {tmp_path / 'step0000004.ckpt'}: not a readable checkpoint" in caplog.text


def test_unreadable_checkpoints_are_named(tmp_path):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(CorruptCheckpointError, match=f"{bad}: not a readable checkpoint"):
        resume_path(str(bad), tmp_path)
    with pytest.raises(CorruptCheckpointError, match=r"none of the 1 checkpoints in .* is readable \(bad.ckpt\)"):
        resume_path("last", tmp_path)
    with pytest.raises(CorruptCheckpointError, match=f"{bad}: not a readable checkpoint"):
        AtomicCheckpointIO().load_checkpoint(bad)
    torch.save({"weights": torch.zeros(3)}, tmp_path / "other.ckpt")
    with pytest.raises(CorruptCheckpointError, match="not a Lightning checkpoint"):
        resume_path(str(tmp_path / "other.ckpt"), tmp_path)


def test_a_sharded_checkpoint_folder_counts_once_its_marker_is_written(tmp_path):
    folder = tmp_path / "last.ckpt"
    (folder / "shards").mkdir(parents=True)
    save(tmp_path / "step0000002.ckpt", 2)
    assert resume_path("last", tmp_path) == str(tmp_path / "step0000002.ckpt")  # the folder's save did not finish
    (folder / ".metadata").write_bytes(b"")  # DCP writes it after every shard
    assert resume_path("last", tmp_path) == str(folder)


def test_a_first_run_with_ckpt_path_last_starts_fresh(tmp_path):
    assert resume_path("last", tmp_path / "checkpoints") is None
    assert resume_path(None, tmp_path) is None


def test_last_ckpt_holds_the_final_step_when_it_is_not_a_multiple_of_the_interval(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_last=True)
    trainer = L.Trainer(
        max_steps=6,
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[AtomicCheckpointIO()],
    )
    trainer.fit(LinearModule(), train_dataloaders=torch.utils.data.DataLoader(torch.randn(64, 2), batch_size=2))
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 6
    assert not list(tmp_path.glob("*.partial"))
