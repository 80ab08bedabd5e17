"""Checkpoints that run no code (glm46.checkpoint.safe_load): a checkpoint whose pickle asks for anything beyond the
types glm46's own checkpoints hold is refused by every reader, naming the file and what it asked for, and nothing
of it runs: the crafted payloads below write a marker file when unpickled without limits, and the marker must not
appear. The project's own checkpoints of every engine load through the same readers (the resume tests)."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from glm46.checkpoint.atomic import AtomicCheckpointIO, resume_path
from glm46.checkpoint.reshard import written_by
from glm46.checkpoint.safe_load import UnsafeCheckpointError, check_safe
from glm46.checkpoint.weights import load_weights

from .helpers import random_model, tiny_config
from .unsafe_pickles import WritesMarker, unsafe_checkpoint, unsafe_dcp_folder

REPO = Path(__file__).resolve().parents[1]


def unsafe_metadata_folder(folder: Path, marker: Path) -> Path:
    """A DCP folder whose `.metadata` (read by torch with a plain pickle.load) is the payload."""
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(WritesMarker(marker)))
    return folder


CRAFTED = {  # name -> (maker, the file the refusal names)
    "ckpt": (lambda d, m: unsafe_checkpoint(d / "unsafe.ckpt", m), "unsafe.ckpt"),
    "dcp-item": (lambda d, m: unsafe_dcp_folder(d / "unsafe_dcp", m), "unsafe_dcp/__0_0.distcp (item evil)"),
    "dcp-metadata": (lambda d, m: unsafe_metadata_folder(d / "unsafe_meta", m), "unsafe_meta/.metadata"),
}


def test_the_crafted_checkpoints_run_code_when_unpickled_without_limits(tmp_path):
    """The payloads are live: torch.load(weights_only=False) and DCP's own load (which unpickles its items and its
    .metadata freely) write the marker. Without this, the refusals below would prove nothing."""
    marker = tmp_path / "marker"
    torch.load(unsafe_checkpoint(tmp_path / "unsafe.ckpt", marker), weights_only=False)
    assert marker.exists()
    marker.unlink()
    dcp.load({"evil": None}, checkpoint_id=unsafe_dcp_folder(tmp_path / "dcp", marker), no_dist=True)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(AttributeError):  # the payload has run; its result (os.system's status) is no Metadata
        dcp.FileSystemReader(unsafe_metadata_folder(tmp_path / "meta", marker)).read_metadata()  # as dcp.load does
    assert marker.exists()


def _readers(path: Path) -> dict:
    model = random_model(tiny_config())
    return {
        "check_safe": lambda: check_safe(path),
        "init_from (load_weights)": lambda: load_weights(model, path),
        "ckpt_path (resume_path)": lambda: resume_path(str(path), path.parent),
        "ckpt_path (Lightning's checkpoint IO)": lambda: AtomicCheckpointIO().load_checkpoint(path),
        "the layout record (written_by)": lambda: written_by(path),
    }


@pytest.mark.parametrize("crafted", CRAFTED)
def test_every_reader_refuses_an_unsafe_checkpoint_naming_the_file_and_the_type(tmp_path, crafted):
    make, named = CRAFTED[crafted]
    marker = tmp_path / "marker"
    path = make(tmp_path, marker)
    for reader, read in _readers(path).items():
        if reader == "the layout record (written_by)" and crafted != "ckpt":
            continue  # of a folder it reads only meta.pt (safely), after the resume has checked the folder
        with pytest.raises(UnsafeCheckpointError) as error:
            read()
        assert f"{tmp_path / named}: refused: its pickle asks for posix.system" in str(error.value), reader
        assert not marker.exists(), reader


def test_ckpt_path_last_refuses_an_unsafe_checkpoint_in_the_run_directory(tmp_path):
    """A planted last.ckpt is refused, not skipped as unreadable: the run stops rather than resume from older
    weights while something tampers with its directory."""
    marker = tmp_path / "marker"
    unsafe_checkpoint(tmp_path / "last.ckpt", marker)
    with pytest.raises(UnsafeCheckpointError, match=r"last\.ckpt: refused: its pickle asks for posix\.system"):
        resume_path("last", tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("key", ["init_from", "ckpt_path"])
def test_run_py_refuses_an_unsafe_checkpoint_before_anything_runs(tmp_path, key):
    marker = tmp_path / "marker"
    path = unsafe_checkpoint(tmp_path / "unsafe.ckpt", marker)
    result = subprocess.run(
        [sys.executable, str(REPO / "run.py"), "experiment=tiny_bytes", f"{key}={path}", f"hydra.run.dir={tmp_path}/r"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert result.returncode != 0
    assert f"{key}={path}: {path}: refused: its pickle asks for posix.system" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not marker.exists()
    assert not list((tmp_path / "r").rglob("*.ckpt"))


def test_the_allowlist_reads_every_engine_s_checkpoint_layout(tmp_path):
    """A DCP folder as the mesh layouts write it (tensors, a non-tensor item, torch.Size and dtypes in .metadata)
    and a one-file checkpoint with generator states pass; the resume tests read real ones of every engine."""
    from glm46.checkpoint.training_state import rng_states

    dcp.save(
        {"state_dict": {"w": torch.zeros(2, 3, dtype=torch.bfloat16)}, "optimizer": {"param_groups": [{"lr": 0.1}]}},
        checkpoint_id=tmp_path / "dcp",
        no_dist=True,
    )
    check_safe(tmp_path / "dcp")
    AtomicCheckpointIO().save_checkpoint({"global_step": 3, "rng": rng_states()}, tmp_path / "file.ckpt")
    assert AtomicCheckpointIO().load_checkpoint(tmp_path / "file.ckpt")["global_step"] == 3
    shutil.rmtree(tmp_path / "dcp")
