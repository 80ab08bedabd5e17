"""A sweep's members side by side, with the noise measured: `python -m glm46.compare <sweep dir or run dirs...>`.

One row per member: the overrides that vary across the sweep, its state (a member that failed, died or never
started is listed with its Slurm job id, never dropped), then its outcomes (final train loss, best and last
validation loss, tokens/s, every lm-eval metric of its eval/results.json). Members that differ only by `seed` form a
group: mean and 95% interval (Student's t) per outcome. Each pair of groups that differ in one key is compared
member by member on the same seed: the mean paired difference and its 95% interval, and whether it excludes zero.
Only completed members count in the statistics.

Into the sweep directory (or --output): summary.md (the tables), summary.csv (the member rows) and
loss_curves.png (train and validation loss against tokens seen, one line per member, the legend naming only the
varied overrides). A local multirun writes them as its members end (glm46.app.sweep); a Slurm sweep, when
`hydra.launcher.wait=true`, once its jobs end; otherwise run this command when they have.

    python -m glm46.compare multirun/train/2026-11-26_01-15-54_1234
    python -m glm46.compare outputs/train/A outputs/train/B --output /tmp/ab
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from glm46.run_files import STATE_FILE, SWEEP_FILE, is_run_dir, read_json

SEED = "seed"
# (column, metric in metrics.csv, which value): the outcomes every training run logs.
OUTCOMES = (
    ("train/loss", "train/loss", "last"),
    ("val/loss best", "val/loss", "min"),
    ("val/loss last", "val/loss", "last"),
    ("val/accuracy", "val/accuracy", "last"),  # RL (module=grpo): held-out reward
    ("tokens/s", "perf/tokens_per_sec", "median"),
)
ALIVE = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING"}


class CompareError(Exception):
    """A path that is neither a run directory nor a sweep directory."""


@dataclass
class Member:
    name: str
    run_dir: Path
    overrides: list[str]
    state: str = "unknown"
    job_id: str | None = None
    error: str | None = None
    outcomes: dict[str, float] = field(default_factory=dict)

    @property
    def settings(self) -> dict[str, str]:
        """{key: value} of its overrides (`+key=v` and `++key=v` as `key`)."""
        pairs = (override.partition("=") for override in self.overrides)
        return {key.lstrip("+~"): value for key, _, value in pairs}


# --- members -----------------------------------------------------------------------------------------------------


def _natural(name: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def find_members(paths: list[Path]) -> tuple[list[Member], Path | None]:
    """The members named by `paths` (run directories, or sweep directories holding them) and the sweep directory
    when one alone was given."""
    members: list[Member] = []
    for path in paths:
        if is_run_dir(path) and not (path / SWEEP_FILE).is_file():
            members.append(Member(str(path), path, _overrides(path)))
        elif path.is_dir():
            members += _sweep_members(path)
        else:
            raise CompareError(f"{path}: neither a run directory (.hydra/config.yaml) nor a sweep directory")
    if not members:
        raise CompareError(f"no run directories in {' '.join(map(str, paths))}")
    sweep_dir = paths[0] if len(paths) == 1 and not is_run_dir(paths[0]) else None
    _read_states(members)
    for member in members:
        member.outcomes = read_outcomes(member.run_dir)
    return members, sweep_dir


def _sweep_members(sweep_dir: Path) -> list[Member]:
    """The manifest's members (those not started included), then any other run directory inside."""
    manifest = read_json(sweep_dir / SWEEP_FILE) or {"members": []}
    members = [
        Member(entry["dir"], sweep_dir / entry["dir"], list(entry["overrides"]), job_id=entry.get("job_id"))
        for entry in manifest["members"]
    ]
    listed = {member.name for member in members}
    others = sorted(
        (p for p in sweep_dir.iterdir() if p.name not in listed and is_run_dir(p)), key=lambda p: _natural(p.name)
    )
    members += [Member(p.name, p, []) for p in others]
    for member in members:
        member.overrides = _overrides(member.run_dir) or member.overrides
    return members


def _overrides(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    return [str(o) for o in yaml.safe_load(path.read_text()) or []] if path.is_file() else []


def _read_states(members: list[Member]) -> None:
    records = {m.run_dir: read_json(m.run_dir / STATE_FILE) for m in members}
    for member in members:
        member.job_id = member.job_id or (records[member.run_dir] or {}).get("job_id")
    slurm = sacct_states([m.job_id for m in members if m.job_id])
    for member in members:
        record = records[member.run_dir]
        member.state = member_state(record, slurm.get(member.job_id or ""), member.run_dir.is_dir())
        member.error = (record or {}).get("error")


def sacct_states(job_ids: list[str]) -> dict[str, str]:
    """{job id: Slurm state} from sacct; {} where there is no Slurm or it does not answer."""
    if not job_ids:
        return {}
    try:
        out = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    lines = (line.split("|") for line in out.splitlines() if "|" in line)
    return {job: state.split()[0] for job, state in lines if state}


def member_state(record: dict | None, slurm: str | None, started: bool) -> str:
    """The member's state: Slurm's while the job is queued or running (a run that has written its end is only
    exiting: its own word counts); else what the run wrote (state.json), unless it never wrote its end: then Slurm's
    final state, or `died` when its process is gone from this host."""
    ended = record is not None and record["state"] in ("completed", "failed")
    if slurm in ALIVE and not (ended and slurm in ("RUNNING", "COMPLETING")):
        return slurm.lower()
    if record is None:
        return slurm.lower() if slurm else ("unknown" if started else "not started")
    if record["state"] != "running":
        return record["state"]
    if slurm:
        return "died" if slurm == "COMPLETED" else slurm.lower()  # killed before it could write its end
    if record.get("host") == socket.gethostname() and not _alive(record.get("pid")):
        return "died"
    return "running"


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- outcomes ----------------------------------------------------------------------------------------------------


def read_outcomes(run_dir: Path) -> dict[str, float]:
    """The run's outcomes (OUTCOMES from metrics.csv, then every lm-eval metric of eval/results.json)."""
    from glm46.reports.plots import read_metrics

    outcomes = {}
    if (run_dir / "metrics.csv").is_file():
        metrics = read_metrics(run_dir / "metrics.csv")
        pick = {"last": lambda v: v[-1], "min": np.min, "median": np.median}
        for column, metric, which in OUTCOMES:
            if metric in metrics:
                outcomes[column] = float(pick[which](metrics[metric][1]))
    results = run_dir / "eval" / "results.json"
    if results.is_file():
        from glm46.eval import summarize

        scores = summarize(read_json(results) or {"results": {}})
        outcomes.update({name: value for name, value in scores.items() if not name.endswith("/n")})
    return outcomes


def varied_keys(members: list[Member]) -> list[str]:
    """The override keys whose values differ across the members, in command-line order."""
    keys = list(dict.fromkeys(key for m in members for key in m.settings))
    return [key for key in keys if len({m.settings.get(key) for m in members}) > 1]


# --- noise -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    n: int
    mean: float
    low: float | None  # the 95% interval; None below two values
    high: float | None

    @property
    def excludes_zero(self) -> bool | None:
        return None if self.low is None else (self.low > 0 or self.high < 0)


def estimate(values: list[float]) -> Estimate:
    """Mean and 95% interval of independent values (Student's t with n - 1 degrees of freedom)."""
    from scipy.stats import t

    n = len(values)
    mean = float(np.mean(values)) if n else math.nan
    if n < 2:
        return Estimate(n, mean, None, None)
    half = float(t.ppf(0.975, n - 1) * np.std(values, ddof=1) / math.sqrt(n))
    return Estimate(n, mean, mean - half, mean + half)


def groups(members: list[Member], varied: list[str]) -> dict[tuple, list[Member]]:
    """Completed members by their varied settings other than the seed: the replicates of one configuration."""
    keys = [key for key in varied if key != SEED]
    grouped: dict[tuple, list[Member]] = {}
    for member in members:
        if member.state == "completed":
            grouped.setdefault(tuple((k, member.settings.get(k)) for k in keys), []).append(member)
    return grouped


@dataclass(frozen=True)
class Pair:
    key: str  # the one setting the two groups differ in
    before: str
    after: str
    fixed: str  # the other settings, shared
    outcome: str
    difference: Estimate  # after - before, paired by seed


def paired_differences(grouped: dict[tuple, list[Member]], outcomes: list[str]) -> list[Pair]:
    """For each two groups that differ in one setting: after - before per seed both ran, for every outcome."""
    pairs = []
    for (a, members_a), (b, members_b) in itertools.combinations(grouped.items(), 2):
        differing = [i for i, ((_, x), (_, y)) in enumerate(zip(a, b)) if x != y]
        if len(differing) != 1:
            continue
        key = a[differing[0]][0]
        fixed = " ".join(f"{k}={v}" for i, (k, v) in enumerate(a) if i != differing[0] and v is not None)
        by_seed_a = {m.settings.get(SEED): m for m in members_a}
        by_seed_b = {m.settings.get(SEED): m for m in members_b}
        seeds = [s for s in by_seed_a if s in by_seed_b]
        for outcome in outcomes:
            values = [
                by_seed_b[s].outcomes[outcome] - by_seed_a[s].outcomes[outcome]
                for s in seeds
                if outcome in by_seed_a[s].outcomes and outcome in by_seed_b[s].outcomes
            ]
            if values:
                pairs.append(Pair(key, a[differing[0]][1], b[differing[0]][1], fixed, outcome, estimate(values)))
    return pairs


# --- the summary -------------------------------------------------------------------------------------------------


@dataclass
class Summary:
    members: list[Member]
    varied: list[str]
    outcomes: list[str]
    grouped: dict[tuple, list[Member]]
    pairs: list[Pair]


def summarize(members: list[Member]) -> Summary:
    varied = varied_keys(members)
    outcomes = list(dict.fromkeys(name for m in members for name in m.outcomes))
    grouped = groups(members, varied)
    return Summary(members, varied, outcomes, grouped, paired_differences(grouped, outcomes))


def _number(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:#.4g}" if abs(value) < 1000 else f"{value:,.0f}"


def _signed(value: float) -> str:
    return ("+" if value >= 0 else "") + _number(value)


def member_rows(summary: Summary) -> tuple[list[str], list[list[str]]]:
    header = ["member", *summary.varied, "state", "job id", *summary.outcomes]
    rows = [
        [m.name, *(m.settings.get(k, "") for k in summary.varied), m.state, m.job_id or "", *(
            _number(m.outcomes.get(o)) for o in summary.outcomes
        )]
        for m in summary.members
    ]  # fmt: skip
    return header, rows


def group_rows(summary: Summary) -> tuple[list[str], list[list[str]]]:
    keys = [k for k in summary.varied if k != SEED]
    header = [*keys, "n", *(f"{o} (95% CI)" for o in summary.outcomes)]
    rows = []
    for group, members in summary.grouped.items():
        cells = []
        for outcome in summary.outcomes:
            e = estimate([m.outcomes[outcome] for m in members if outcome in m.outcomes])
            interval = "" if e.low is None else f" [{_number(e.low)}, {_number(e.high)}]"
            cells.append(_number(e.mean) + interval if e.n else "-")
        rows.append([*(v or "" for _, v in group), str(len(members)), *cells])
    return header, rows


def pair_rows(summary: Summary) -> tuple[list[str], list[list[str]]]:
    header = ["change", "with", "outcome", "seeds", "difference", "95% CI", "excludes 0"]
    rows = []
    for p in summary.pairs:
        d = p.difference
        interval = "-" if d.low is None else f"[{_signed(d.low)}, {_signed(d.high)}]"
        excludes = {None: "-", True: "yes", False: "no"}[d.excludes_zero]
        rows.append(
            [f"{p.key}: {p.before} -> {p.after}", p.fixed, p.outcome, str(d.n), _signed(d.mean), interval, excludes]
        )
    return header, rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def format_summary(summary: Summary) -> str:
    sections = ["## Members", markdown(*member_rows(summary))]
    unfinished = [m for m in summary.members if m.state != "completed"]
    if unfinished:
        sections.append(
            "Not in the statistics: "
            + "; ".join(f"{m.name} {m.state}" + (f" ({m.error})" if m.error else "") for m in unfinished)
        )
    if summary.grouped:
        sections += ["## Groups (members that differ only by seed)", markdown(*group_rows(summary))]
    if summary.pairs:
        sections += ["## Paired differences (after - before, on the same seeds)", markdown(*pair_rows(summary))]
        found = [p for p in summary.pairs if p.difference.excludes_zero]
        sections.append(
            "Beyond noise (95% interval excludes 0): "
            + ("; ".join(f"{p.key} {p.before} -> {p.after} on {p.outcome} {_signed(p.difference.mean)}" for p in found)
               or "none")
        )  # fmt: skip
    if all(len(members) < 2 for members in summary.grouped.values()):
        sections.append("No replicates: add seed=0,1,2 to the sweep to measure the noise.")
    return "\n\n".join(sections)


def label(member: Member, varied: list[str]) -> str:
    return " ".join(f"{k}={member.settings[k]}" for k in varied if k in member.settings) or member.name


def write_summary(summary: Summary, folder: Path) -> list[Path]:
    """summary.md, summary.csv and loss_curves.png in `folder`."""
    from glm46.reports.plots import plot_sweep

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.md").write_text(format_summary(summary) + "\n")
    header, rows = member_rows(summary)
    with open(folder / "summary.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    configurations = [k for k in summary.varied if k != SEED]
    colors, styles = {}, {}
    curves = [
        (
            label(m, summary.varied),
            m.run_dir / "metrics.csv",
            colors.setdefault(tuple(m.settings.get(k) for k in configurations), len(colors)),
            styles.setdefault(m.settings.get(SEED), len(styles)),
            m.state == "completed",
        )
        for m in summary.members
    ]
    plotted = plot_sweep(curves, folder / "loss_curves.png")
    return [folder / "summary.md", folder / "summary.csv", *plotted]


def report(paths: list[Path], output: Path | None = None, show: bool = True) -> Summary:
    """The summary of the members `paths` name, written into `output` (default: the sweep directory, when one alone
    was given) and printed when `show`. Raises CompareError for a path that names no run."""
    members, sweep_dir = find_members(paths)
    summary = summarize(members)
    folder = output or sweep_dir
    written = write_summary(summary, folder) if folder is not None else []
    if show:
        print(format_summary(summary), flush=True)
        if written:
            print(f"sweep summary: {', '.join(str(p) for p in written)}", flush=True)
    return summary


def summarize_sweep(sweep_dir: Path, show: bool = True) -> Summary:
    """The sweep's summary written into it; printed too when `show`."""
    return report([sweep_dir], sweep_dir, show)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m glm46.compare",
        description="A sweep's members side by side: varied overrides, outcomes, seed groups, paired differences.",
    )
    parser.add_argument("paths", nargs="+", type=Path, help="a sweep directory, or run directories")
    parser.add_argument("--output", type=Path, default=None, help="where to write the summary (default: the sweep)")
    args = parser.parse_args(argv)
    try:
        report(args.paths, args.output)
    except CompareError as e:
        print(f"glm46.compare: {e}", file=sys.stderr)
        return 2
    return 0
