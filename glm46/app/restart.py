"""Automatic restart of a failed Slurm job, bounded. The launcher ends every training job's batch script with

    status=$?; python -m glm46.app.restart --status $status --run-dir DIR ...; exit $status

(hydra_plugins/glm46_launcher, when cluster.max_restarts > 0). A step that failed (a rank died, an NCCL error, a hang
the watchdog ended) requeues its job, which resumes in the same run directory from its newest checkpoint
(`ckpt_path=last`), at most `cluster.max_restarts` times, and at most `cluster.restarts_without_progress` times in a
row without a new checkpoint: a failure that repeats at the same step (a bad configuration, a data error) stops
instead of looping. Every failure, its cause (the last error lines of the job's logs) and the decision are appended
to `<run dir>/restarts.json`.

A lost node is Slurm's to handle: once the node stops answering (SlurmdTimeout) the controller ends the whole
job (NODE_FAIL; the batch script may have been on that node) and requeues it onto healthy nodes, the lost one
being DOWN. So the batch script also starts with `python -m glm46.app.restart --at-start ...`, which records each
earlier attempt of the job that ended NODE_FAIL (from sacct), naming the nodes of its allocation that are down now,
under the same limits: past them, the job ends there.
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


def read_history(run_dir: Path) -> list[dict]:
    record = run_dir / RECORD
    return json.loads(record.read_text()) if record.is_file() else []


def write_history(run_dir: Path, history: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RECORD).write_text(json.dumps(history, indent=2))


def lost_nodes(nodelist: str) -> list[str]:
    """The nodes of `nodelist` (Slurm's compressed form) that Slurm now holds down, failed or not responding."""
    if not nodelist:
        return []
    shown = subprocess.run(["sinfo", "-h", "-N", "-n", nodelist, "-o", "%N %T"], capture_output=True, text=True)
    states = dict(line.split() for line in shown.stdout.splitlines() if len(line.split()) == 2)  # one call, any size
    return sorted(n for n, s in states.items() if any(word in s.lower() for word in ("down", "fail", "drain", "*")))


def node_failures(job: str) -> list[dict]:
    """The job's earlier attempts that ended NODE_FAIL, from sacct (--duplicates lists every attempt of a requeued
    job, in order): [{attempt, end, nodelist}], oldest first."""
    out = subprocess.run(
        ["sacct", "-j", job, "--duplicates", "-X", "-n", "-P", "-o", "State,NodeList,End"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    records = [line.split("|") for line in out.splitlines() if line.count("|") == 2]
    return [
        {"attempt": attempt, "end": end, "nodelist": nodes}
        for attempt, (state, nodes, end) in enumerate(records)
        if state.startswith("NODE_FAIL")
    ]


def record_node_failures(run_dir: Path, max_restarts: int, without_progress: int) -> bool:
    """At the start of an attempt: append to restarts.json every NODE_FAIL attempt of this job that its own batch
    script did not record (it ran on the lost node, or Slurm ended it first), with the nodes lost; False when the
    limits say the job should not go on."""
    job = os.environ.get("SLURM_JOB_ID", "")
    if attempt() == 0 or not job:
        return True
    history = read_history(run_dir)
    seen = {(entry["job_id"], entry.get("attempt")) for entry in history}
    restart = True
    for failure in node_failures(job):
        if (job, failure["attempt"]) in seen:
            continue
        step = newest_step(run_dir)
        restart, decision = decide(history, step, max_restarts, without_progress)
        lost = lost_nodes(failure["nodelist"])
        history.append(
            {
                "failure": len(history) + 1,
                "time": failure["end"],
                "job_id": job,
                "attempt": failure["attempt"],
                "exit_status": None,
                "checkpoint_step": step,
                "cause": f"NODE_FAIL: node(s) {', '.join(lost) or '?'} of {failure['nodelist']} lost; Slurm ended "
                f"the job and requeued it",
                "lost_nodes": lost,
                "decision": decision if not restart else "restarted (requeued by Slurm, away from the lost nodes)",
            }
        )
        print(f"{REPORT} failure {len(history)} at checkpoint step {step}: {history[-1]['cause']}; {decision}")
    if history:
        write_history(run_dir, history)
    return restart


def attempt() -> int:
    """Which run of the job this is: 0, then one more at each requeue (Slurm's restart count)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0"))


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
    when = parser.add_mutually_exclusive_group(required=True)
    when.add_argument("--status", type=int, help="after the job's step: its exit status (srun)")
    when.add_argument("--at-start", action="store_true", help="before the job's step: record lost nodes")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--max-restarts", type=int, required=True)
    parser.add_argument("--without-progress", type=int, required=True)
    args = parser.parse_args(argv)
    if args.at_start:
        return 0 if record_node_failures(args.run_dir, args.max_restarts, args.without_progress) else 1
    if args.status == 0:
        return 0
    history = read_history(args.run_dir)
    step = newest_step(args.run_dir)
    restart, decision = decide(history, step, args.max_restarts, args.without_progress)
    lost = lost_nodes(os.environ.get("SLURM_JOB_NODELIST", ""))  # a requeue goes elsewhere: they are down
    cause = failure_cause(job_logs(), args.status)
    entry = {
        "failure": len(history) + 1,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "attempt": attempt(),
        "exit_status": args.status,
        "checkpoint_step": step,
        "cause": f"node(s) {', '.join(lost)} lost; {cause}" if lost else cause,
        "lost_nodes": lost,
        "decision": decision,
    }
    write_history(args.run_dir, history + [entry])
    print(f"{REPORT} failure {entry['failure']} at checkpoint step {step}: {entry['cause']}; {decision}")
    if restart:
        requeue = subprocess.run(["scontrol", "requeue", requeue_id()], capture_output=True, text=True, check=False)
        if requeue.returncode != 0:  # Slurm may be requeueing it already (a node it lost: NODE_FAIL)
            print(f"{REPORT} scontrol requeue {requeue_id()}: {requeue.stderr.strip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
