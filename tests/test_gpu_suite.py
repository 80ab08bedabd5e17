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
    assert set(by_part) == {"environment", "parity", "packed", "context", "compile", "memory", "throughput"}
    assert not [r for r in rows if r["verdict"] == "FAIL"]
    checked = [r for r in rows if r["verdict"] == "pass"]
    assert {r["part"] for r in checked} == {"environment", "parity", "context"}
    # cp 2 and 4 in fp32 against one device; in bf16 the CPU blocks are the reference of the CUDA ones (info here)
    assert [r["verdict"] for r in by_part["context"]] == ["info", "info", "pass", "pass"]
    skipped = {r["part"] for r in rows if r["verdict"] == "skip"}
    assert skipped == {"packed", "compile", "memory"}  # the CUDA-only parts, each saying why
    checks = {r["check"] for r in by_part["throughput"]}
    assert {"glm46 AdamW / torchtitan AdamW", "glm46 Muon / torchtitan AdamW"} <= checks
    assert "== GPU suite" in result.stdout
