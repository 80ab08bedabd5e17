"""Ablations: `python -m glm46.compare` puts a sweep's members side by side with the noise measured (seed groups,
paired differences with Student-t intervals), lists members that failed, died or never started, and a multirun
writes that summary itself: locally as its members end, on the local Slurm when the launcher waits."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from glm46.reports.config_diff import diff_specs, format_text
from glm46.reports.plots import read_metrics
from glm46.reports.sweep_summary import Member, estimate, find_members, main, member_state, read_outcomes, summarize

from . import forked
from .slurm import require_slurm

REPO = Path(__file__).resolve().parents[1]
T_975 = {1: 12.706204736, 2: 4.302652730}  # Student's t, 97.5% quantile, by degrees of freedom (tables)


def write_run(run_dir: Path, overrides: list[str], val: list[float], state: str = "completed", **record) -> Path:
    """A run directory as training leaves it: .hydra/, metrics.csv (train and val loss by tokens) and state.json."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"seed": 0}))
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    rows = [["step", "train/loss", "train/tokens_seen", "perf/tokens_per_sec", "val/loss"]]
    for step, value in enumerate(val, start=1):
        rows.append([step * 10 - 1, value + 0.5, step * 1000, 100.0 * step, value])
    with open(run_dir / "metrics.csv", "w", newline="") as f:
        csv.writer(f).writerows(rows)
    (run_dir / "state.json").write_text(json.dumps({"state": state, **record}))
    return run_dir


def write_sweep(sweep_dir: Path, members: dict[str, tuple[list[str], list[float]]], states: dict | None = None) -> Path:
    manifest = []
    for name, (overrides, val) in members.items():
        write_run(sweep_dir / name, overrides, val, **(states or {}).get(name, {}))
        manifest.append({"dir": name, "overrides": overrides, "job_id": None})
    (sweep_dir / "sweep.json").write_text(json.dumps({"members": manifest}))
    return sweep_dir


# --- the statistics, on runs written by hand ---------------------------------------------------------------------


def test_seed_groups_and_paired_differences_equal_the_textbook_intervals(tmp_path):
    """optim=muon,adamw x seed=0,1,2; adamw's best val loss is 0.10, 0.12, 0.14 above muon's on seeds 0, 1, 2."""
    muon = {0: 3.00, 1: 3.20, 2: 3.10}
    adamw = {s: muon[s] + d for s, d in zip(muon, (0.10, 0.12, 0.14))}
    members = {}
    for optim, values in (("muon", muon), ("adamw", adamw)):
        for seed, best in values.items():
            members[str(len(members))] = ([f"optim={optim}", f"seed={seed}"], [best + 1.0, best])
    members_found, sweep_dir = find_members([write_sweep(tmp_path, members)])
    summary = summarize(members_found)

    assert sweep_dir == tmp_path and summary.varied == ["optim", "seed"]
    assert [m.settings for m in summary.members][:2] == [{"optim": "muon", "seed": "0"}, {"optim": "muon", "seed": "1"}]
    assert summary.outcomes == ["train/loss", "val/loss best", "val/loss last", "tokens/s"]
    assert [(key, len(group)) for key, group in summary.grouped.items()] == [
        ((("optim", "muon"),), 3),
        ((("optim", "adamw"),), 3),
    ]
    # the group of muon: mean 3.1, sd 0.1 over 3 seeds
    group = estimate([m.outcomes["val/loss best"] for m in summary.grouped[(("optim", "muon"),)]])
    half = T_975[2] * 0.1 / math.sqrt(3)
    assert group.n == 3 and group.mean == pytest.approx(3.1) and group.high == pytest.approx(3.1 + half)

    (pair,) = [p for p in summary.pairs if p.outcome == "val/loss best"]
    assert (pair.key, pair.before, pair.after, pair.fixed) == ("optim", "muon", "adamw", "")
    half = T_975[2] * 0.02 / math.sqrt(3)  # differences 0.10, 0.12, 0.14: mean 0.12, sd 0.02
    assert pair.difference.n == 3 and pair.difference.mean == pytest.approx(0.12)
    assert (pair.difference.low, pair.difference.high) == (pytest.approx(0.12 - half), pytest.approx(0.12 + half))
    assert pair.difference.excludes_zero
    # tokens/s is the same in every run: a difference of 0 with a zero-width interval does not exclude 0
    (speed,) = [p for p in summary.pairs if p.outcome == "tokens/s"]
    assert speed.difference.mean == 0 and not speed.difference.excludes_zero

    text = (tmp_path / "summary.md").read_text() if main([str(tmp_path)]) == 0 else ""
    (beyond,) = [line for line in text.splitlines() if line.startswith("Beyond noise (95% interval excludes 0): ")]
    assert "optim muon -> adamw on val/loss best +0.1200" in beyond and "tokens/s" not in beyond
    rows = list(csv.reader((tmp_path / "summary.csv").open()))
    assert rows[0][:5] == ["member", "optim", "seed", "state", "job id"] and len(rows) == 7
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_seeds_give_an_interval_twelve_standard_errors_wide(tmp_path):
    """With 2 seeds, t has 1 degree of freedom (12.7): an honest interval, wide; the summary says it does not exclude
    0 even for a difference that is the same sign on both seeds."""
    members = {
        "0": (["optim=muon", "seed=0"], [3.0]),
        "1": (["optim=muon", "seed=1"], [3.1]),
        "2": (["optim=adamw", "seed=0"], [3.1]),
        "3": (["optim=adamw", "seed=1"], [3.3]),
    }
    summary = summarize(find_members([write_sweep(tmp_path, members)])[0])
    (pair,) = [p for p in summary.pairs if p.outcome == "val/loss last"]
    half = T_975[1] * np.std([0.1, 0.2], ddof=1) / math.sqrt(2)
    assert pair.difference.mean == pytest.approx(0.15) and pair.difference.high == pytest.approx(0.15 + half)
    assert pair.difference.excludes_zero is False


def test_pairs_differ_in_one_key_and_without_seeds_there_is_no_interval(tmp_path):
    """optim x lr without replicates: 4 groups of one, 4 pairs (never the diagonal), each n=1 without an interval."""
    members = {
        str(i): ([f"optim={optim}", f"optim.lr={lr}"], [3.0 + i / 10])
        for i, (optim, lr) in enumerate([("muon", "0.001"), ("muon", "0.003"), ("adamw", "0.001"), ("adamw", "0.003")])
    }
    summary = summarize(find_members([write_sweep(tmp_path, members)])[0])
    changes = {(p.key, p.before, p.after, p.fixed) for p in summary.pairs if p.outcome == "val/loss last"}
    assert changes == {
        ("optim.lr", "0.001", "0.003", "optim=muon"),
        ("optim.lr", "0.001", "0.003", "optim=adamw"),
        ("optim", "muon", "adamw", "optim.lr=0.001"),
        ("optim", "muon", "adamw", "optim.lr=0.003"),
    }
    assert all(p.difference.n == 1 and p.difference.low is None for p in summary.pairs)
    main([str(tmp_path)])
    assert "No replicates: add seed=0,1,2 to the sweep" in (tmp_path / "summary.md").read_text()


def test_failed_died_and_unstarted_members_are_listed_and_left_out_of_the_statistics(tmp_path):
    members = {
        "0": (["seed=0"], [3.0]),
        "1": (["seed=1"], [3.2]),
        "2": (["seed=2"], [3.4]),  # failed
        "3": (["seed=3"], [3.6]),  # its process is gone without writing its end
    }
    states = {
        "2": {"state": "failed", "error": "RuntimeError: planted"},
        "3": {"state": "running", "pid": 2**22 + 17, "host": os.uname().nodename},  # no such process
    }
    write_sweep(tmp_path, members, states)
    manifest = json.loads((tmp_path / "sweep.json").read_text())
    manifest["members"].append({"dir": "4", "overrides": ["seed=4"], "job_id": "777_4"})  # queued, never started
    (tmp_path / "sweep.json").write_text(json.dumps(manifest))

    summary = summarize(find_members([tmp_path])[0])
    assert [(m.name, m.state) for m in summary.members] == [
        ("0", "completed"),
        ("1", "completed"),
        ("2", "failed"),
        ("3", "died"),
        ("4", "not started"),  # no Slurm answers for 777 here
    ]
    ((_, group),) = summary.grouped.items()
    assert [m.name for m in group] == ["0", "1"]
    assert estimate([m.outcomes["val/loss last"] for m in group]).mean == pytest.approx(3.1)
    main([str(tmp_path)])
    text = (tmp_path / "summary.md").read_text()
    assert "Not in the statistics: 2 failed (RuntimeError: planted); 3 died; 4 not started" in text
    assert "777_4" in text


@pytest.mark.parametrize(
    "record, slurm, started, expected",
    [
        ({"state": "completed"}, "COMPLETED", True, "completed"),
        ({"state": "completed"}, "RUNNING", True, "completed"),  # its end written, the process exiting
        ({"state": "failed"}, "PENDING", True, "pending"),  # requeued by hand after a failure
        ({"state": "interrupted"}, "PENDING", True, "pending"),  # requeued after a preemption: queued again
        ({"state": "running", "host": "elsewhere", "pid": 1}, "OUT_OF_MEMORY", True, "out_of_memory"),
        ({"state": "running", "host": "elsewhere", "pid": 1}, "COMPLETED", True, "died"),  # ended, never wrote its end
        ({"state": "running", "host": "elsewhere", "pid": 1}, None, True, "running"),  # nothing tells otherwise
        (None, "PENDING", False, "pending"),
        (None, "CANCELLED", False, "cancelled"),
        (None, None, False, "not started"),
    ],
)
def test_member_state_from_the_run_and_from_slurm(record, slurm, started, expected):
    assert member_state(record, slurm, started) == expected


def test_outcomes_include_every_lm_eval_metric(tmp_path):
    run = write_run(tmp_path / "run", ["seed=0"], [3.0, 2.5])
    (run / "eval").mkdir()
    results = {"results": {"glm46_arithmetic": {"exact_match,none": 0.25, "exact_match_stderr,none": 0.04}}}
    (run / "eval" / "results.json").write_text(json.dumps({**results, "n-samples": {}}))
    assert read_outcomes(run) == {
        "train/loss": 3.0,
        "val/loss best": 2.5,
        "val/loss last": 2.5,
        "tokens/s": 150.0,
        "glm46_arithmetic/exact_match": 0.25,
    }


def test_a_path_that_is_no_run_answers_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "nowhere: neither a run directory" in capsys.readouterr().err


def test_diff_of_two_run_directories_prints_their_outcomes(tmp_path):
    a = write_run(tmp_path / "a", ["optim=muon"], [3.0, 2.5])
    b = write_run(tmp_path / "b", ["optim=adamw"], [3.0, 2.75])
    result = diff_specs(str(a), str(b))
    assert result["outcomes"]["val/loss best"] == {"a": 2.5, "b": 2.75}
    assert "  val/loss best: 2.5 -> 2.75 (+0.25)" in format_text(result).splitlines()


# --- real sweeps -------------------------------------------------------------------------------------------------

QUICK = [
    "experiment=tiny_bytes",
    "data.max_bytes=200000",
    "data.seq_len=32",  # micro-batches of 2 x 32 tokens: the summary's arithmetic does not need a model that learns
    "data.batch_size=2",
    "trainer.max_steps=12",
    "trainer.val_check_interval=6",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=3",
    "callbacks.progress_bar.refresh_rate=6",
    "callbacks.model_checkpoint.every_n_train_steps=1000",
    "logger=csv",
]


def run_sweep(tmp_path: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "run.py"), "-m", *QUICK, f"paths.sweep_dir={tmp_path}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONWARNINGS", None)
    return forked.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=timeout)


def check_two_by_two(members_dir: Path) -> None:
    """summary.csv of optim=muon,adamw x seed=0,1: four completed rows whose outcomes are their metrics.csv's, and
    summary.md's paired interval recomputed from them."""
    rows = list(csv.DictReader((members_dir / "summary.csv").open()))
    assert [(r["optim"], r["seed"], r["state"]) for r in rows] == [
        ("muon", "0", "completed"),
        ("muon", "1", "completed"),
        ("adamw", "0", "completed"),
        ("adamw", "1", "completed"),
    ]
    last = {}
    for row in rows:
        metrics = read_metrics(members_dir / row["member"] / "metrics.csv")
        last[(row["optim"], row["seed"])] = metrics["val/loss"][1][-1]
        assert float(row["val/loss last"]) == pytest.approx(last[(row["optim"], row["seed"])], rel=1e-3)
        assert float(row["train/loss"]) == pytest.approx(metrics["train/loss"][1][-1], rel=1e-3)
    differences = [last[("adamw", s)] - last[("muon", s)] for s in ("0", "1")]
    mean, half = np.mean(differences), T_975[1] * np.std(differences, ddof=1) / math.sqrt(2)
    lines = (members_dir / "summary.md").read_text().splitlines()
    (line,) = [line for line in lines if line.startswith("| optim: muon -> adamw ") and "| val/loss last " in line]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:4] == ["optim: muon -> adamw", "", "val/loss last", "2"]
    low, high = map(float, re.fullmatch(r"\[(\S+), (\S+)\]", cells[5]).groups())
    assert (float(cells[4]), low, high) == (
        pytest.approx(mean, abs=2e-4),
        pytest.approx(mean - half, abs=2e-3),
        pytest.approx(mean + half, abs=2e-3),
    )
    assert (members_dir / "loss_curves.png").stat().st_size > 10_000


@pytest.mark.slow
def test_a_local_two_by_two_sweep_writes_its_summary(tmp_path):
    result = run_sweep(tmp_path, "optim=muon,adamw", "seed=0,1")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    (sweep_dir,) = (tmp_path / "train").iterdir()
    check_two_by_two(sweep_dir)
    assert output.count("## Paired differences") == 1  # printed once, when the last member ends
    assert f"member 3: completed -> {sweep_dir / '3'}" in output
    # what the user reads: progress as lines (the output is a pipe), none of the dependencies' noise
    assert re.search(r"step 6/12 \(50%\) \| .*train/loss \d", output)
    for noise in ("litlogger", "`srun` command is available", "LeafSpec", "\r"):
        assert noise not in output, noise


@pytest.mark.slow
def test_a_member_made_to_fail_is_listed_as_failed(tmp_path):
    failing = ["+callbacks.fail._target_=tests.helpers.FailForSeed", "+callbacks.fail.seed=${seed}"]
    result = run_sweep(tmp_path, "trainer.max_steps=3", *failing, "+callbacks.fail.failing=1", "seed=0,1")
    output = result.stdout + result.stderr
    assert result.returncode != 0  # Hydra ends a sweep with a failed member in an error, after every member ran
    (sweep_dir,) = (tmp_path / "train").iterdir()
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    assert [(r["seed"], r["state"]) for r in rows] == [("0", "completed"), ("1", "failed")]
    assert "1 failed (RuntimeError: planted failure for this seed)" in (sweep_dir / "summary.md").read_text()
    assert "1 failed (RuntimeError: planted failure for this seed)" in output  # the table is printed all the same
    assert json.loads((sweep_dir / "1" / "state.json").read_text())["state"] == "failed"


@pytest.mark.slurm
@pytest.mark.slow
def test_a_slurm_array_sweep_that_waits_writes_its_summary(tmp_path):
    require_slurm()
    result = run_sweep(
        tmp_path, "cluster=local_slurm", "hydra.launcher.wait=true", "optim=muon,adamw", "seed=0,1", timeout=900
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    (array,) = re.findall(r"^  (\d+)_0: ", result.stdout, flags=re.M)
    members_dir = tmp_path / "train" / array  # the array's members side by side, as a local sweep's
    manifest = json.loads((members_dir / "sweep.json").read_text())
    assert [m["job_id"] for m in manifest["members"]] == [f"{array}_{i}" for i in range(4)]
    check_two_by_two(members_dir)
    rows = list(csv.DictReader((members_dir / "summary.csv").open()))
    assert [r["job id"] for r in rows] == [f"{array}_{i}" for i in range(4)]
    assert f"compare when they end: python -m glm46.compare {members_dir}" in result.stdout
    members, _ = find_members([members_dir])  # the command, run again: the same members, all completed
    assert [m.state for m in members] == ["completed"] * 4 and all(isinstance(m, Member) for m in members)
