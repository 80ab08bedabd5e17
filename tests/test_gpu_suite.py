"""bench/gpu_suite.py --cpu, as CI runs it: every part that can run on a CPU runs and passes, the CUDA-only checks
say so, and the wheel list for the GPU machine matches what this project installs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_suite_runs_its_cpu_parts(tmp_path):
    out = tmp_path / "suite.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_suite.py"), "--cpu", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    by_part = {}
    for row in rows:
        by_part.setdefault(row["part"], []).append(row)
    parts = {"environment", "parity", "packed", "context", "compile", "syncs", "memory", "throughput", "user_path"}
    assert set(by_part) == parts
    assert not [r for r in rows if r["verdict"] == "FAIL"]
    checked = [r for r in rows if r["verdict"] == "pass"]
    assert {r["part"] for r in checked} == {"environment", "parity", "context"}
    # cp 2 and 4 in fp32 against one device; in bf16 the CPU blocks are the reference of the CUDA ones (info here)
    assert [r["verdict"] for r in by_part["context"]] == ["info", "info", "pass", "pass"]
    skipped = {r["part"] for r in rows if r["verdict"] == "skip"}
    assert skipped == {"packed", "compile", "syncs", "memory"}  # the CUDA-only parts, each saying why
    checks = {r["check"] for r in by_part["throughput"]}
    assert {"glm46 AdamW / torchtitan AdamW", "glm46 Muon / torchtitan AdamW"} <= checks
    assert "== GPU suite" in result.stdout
    # the user's path: run.py trained and its rate per step was read from its progress lines
    (user_path,) = by_part["user_path"]
    assert (
        user_path["check"].startswith("python run.py experiment=tiny_bytes")
        and float(user_path["value"].replace(",", "")) > 0
    )


def test_the_model_config_is_the_throughput_preset(compose_config):
    """conf/model/glm46_1b.yaml (what run.py trains in the suite's user path) is bench/train_throughput.py's preset."""
    from bench.train_throughput import PRESETS
    from glm46.config.checks import model_config

    fields, _ = PRESETS["glm46_1b"]
    config = model_config(compose_config("experiment=tiny_bytes", "model=glm46_1b"))
    assert {name: getattr(config, name) for name in fields} == fields
