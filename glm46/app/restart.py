"""Automatic restart of a failed Slurm job, bounded. The launcher ends every training job's batch script with

    status=$?; python -m glm46.app.restart --status $status --run-dir DIR ...; exit $status

(hydra_plugins/glm46_launcher, when cluster.max_restarts > 0). A step that failed (a rank died, a node was lost, an
NCCL error, a hang the watchdog ended) requeues its job, which resumes in the same run directory from its newest
checkpoint (`ckpt_path=last`), at most `cluster.max_restarts` times, and at most
`cluster.restarts_without_progress` times in a row without a new checkpoint: a failure that repeats at the same step
(a bad configuration, a data error) stops instead of looping. Every failure, its cause (the last error lines of
the job's logs) and the decision are appended to `<run dir>/restarts.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from pathlib import Path

RECORD = "restarts.json"
EXCEPTION = re.compile(r"^([\w.]+\.)?\w*(Error|Exception|Interrupt)\b(: .*)?$")  # a traceback's last line
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")  # torchrun-style prefixes of a rank's lines
REPORT = "glm46 restart:"  # how this module's line in the log starts
WATCHDOG = "glm46 watchdog:"  # the line the hang watchdog logs before it ends a rank (glm46.lit.callbacks.watchdog)


def newest_step(run_dir: Path) -> int:
    """The step of the newest periodic checkpoint (`step<N>...` in <run dir>/checkpoints), -1 without one."""
    steps = [int(m.group(1)) for p in (run_dir / "checkpoints").glob("step*") if (m := re.match(r"step(\d+)", p.name))]
    return max(steps, default=-1)


def failure_cause(logs: list[Path], status: int) -> str:
    """What went wrong in the latest attempt (the lines after this module's last report in the log): the first task
    srun saw end (the others were ended because of it) and the last exception raised before that (a chain's
    outermost); else the exit status."""
    for log in logs:
        try:
            lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
        except OSError:
            continue
        reported = [i for i, line in enumerate(lines) if line.startswith(REPORT)]
        attempt = [RANK_PREFIX.sub("", line) for line in lines[reported[-1] + 1 if reported else 0 :]]
        ended = [i for i, line in enumerate(attempt) if line.startswith("srun: error:")]
        before = attempt[: ended[0]] if ended else attempt  # what a task raised after that is a consequence
        raised = [line for line in before if EXCEPTION.match(line) or line.startswith(WATCHDOG)]
        causes = ([raised[-1][:300]] if raised else []) + ([attempt[ended[0]][:300]] if ended else [])
        if causes:
            return f"{log.name}: {'; '.join(causes)}"
    return f"the job step exited with status {status}"


def decide(history: list[dict], step: int, max_restarts: int, without_progress: int) -> tuple[bool, str]:
    """(restart?, why) for a failure at checkpoint `step`, after the failures in `history` (restarts.json)."""
    restarts = sum(entry["decision"] == "restarted" for entry in history)
    if restarts >= max_restarts:
        return False, f"stopped: cluster.max_restarts={max_restarts} restarts already made"
    stuck = 0
    for entry in reversed(history):
        if entry["checkpoint_step"] != step or entry["decision"] != "restarted":
            break
        stuck += 1
    if stuck >= without_progress:
        return False, (
            f"stopped: failed {stuck + 1} times in a row with the newest checkpoint at step {step} "
            f"(cluster.restarts_without_progress={without_progress}): this failure repeats, it needs a person"
        )
    return True, "restarted"


def job_logs() -> list[Path]:
    """The job's log files (its batch output and each task's), newest first, from what Slurm says of the job."""
    job = os.environ.get("SLURM_JOB_ID", "")
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, check=False).stdout
    match = re.search(r"StdOut=(\S+)", shown)
    if not match:
        return []
    stdout = Path(match.group(1))
    prefix = stdout.name.split("_")[0]
    return sorted(stdout.parent.glob(f"{prefix}_*"), key=lambda p: p.stat().st_mtime, reverse=True)


def requeue_id() -> str:
    """The id scontrol requeue takes: `<array job>_<task>` for an array task."""
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ["SLURM_JOB_ID"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm46.app.restart", description=__doc__.split("\n\n")[0])
    parser.add_argument("--status", type=int, required=True, help="the exit status of the job's step (srun)")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--max-restarts", type=int, required=True)
    parser.add_argument("--without-progress", type=int, required=True)
    args = parser.parse_args(argv)
    if args.status == 0:
        return 0
    record = args.run_dir / RECORD
    history = json.loads(record.read_text()) if record.is_file() else []
    step = newest_step(args.run_dir)
    restart, decision = decide(history, step, args.max_restarts, args.without_progress)
    entry = {
        "failure": len(history) + 1,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "exit_status": args.status,
        "checkpoint_step": step,
        "cause": failure_cause(job_logs(), args.status),
        "decision": decision,
    }
    args.run_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(history + [entry], indent=2))
    print(f"{REPORT} failure {entry['failure']} at checkpoint step {step}: {entry['cause']}; {decision}")
    if restart:
        subprocess.run(["scontrol", "requeue", requeue_id()], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
