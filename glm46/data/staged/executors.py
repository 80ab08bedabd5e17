"""Where the stage tasks run: on this machine (processes, stage after stage), or on Slurm as one job array per
stage, each after the one before it (submitit, the launch path training uses). Either runs only the tasks that
have not finished, so rerunning the same command resumes a preparation."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from itertools import takewhile

from glm46.errors import ConfigError

from ..prepare import EmptyDatasetError
from .stages import run_task
from .work import StagedPlan, progress_table, stage_row

log = logging.getLogger(__name__)


class StageFailedError(RuntimeError):
    """A stage task failed: its message names the stage, the task and the error, and how to resume."""


# Raised by a task, these are the data's verdict or a setting that cannot run on this data: rerunning cannot help
VERDICTS = {f"{kind.__module__}.{kind.__qualname__}": kind for kind in (ConfigError, EmptyDatasetError)}


def _failed(plan: StagedPlan, stage: str, index: int, why: str) -> StageFailedError:
    return StageFailedError(
        f"prepare: stage {stage} task {index + 1}/{plan.size(stage)} failed: {why}; "
        f"run the same command again to resume (finished tasks are kept in {plan.work})"
    )


def verdict_in(printed: str) -> Exception | None:
    """A VERDICTS error that a task in another process (or on Slurm) raised, rebuilt from what Python printed for
    it: the last line that starts with its name, and its message's further lines, up to submitit's rule of dashes."""
    lines = printed.splitlines()
    for start in range(len(lines) - 1, -1, -1):
        name, _, first = lines[start].partition(": ")
        if name in VERDICTS:
            rest = takewhile(lambda line: not line.startswith("-----"), lines[start + 1 :])
            return VERDICTS[name]("\n".join([first, *rest]).rstrip())
    return None


def run_local(plan: StagedPlan, workers: int) -> None:
    """Every unfinished task, stage after stage: `workers` at a time as processes of their own (as on Slurm: a task
    that crashes or is killed takes nothing else with it), or all in this process when workers is 1."""
    for stage in plan.stages:
        pending = plan.pending(stage)
        if workers <= 1:
            for index in pending:
                try:
                    run_task(plan.output_dir, stage, index, say=log.debug)  # the stage's row below says it
                except tuple(VERDICTS.values()):
                    raise  # the data's verdict, or a setting that cannot run on this data: rerunning cannot help
                except Exception as error:
                    raise _failed(plan, stage, index, f"{type(error).__name__}: {error}") from error
        else:
            _run_processes(plan, stage, pending, workers)
        log.info(f"prepare: {stage_row(plan, stage)}")
    log.info(f"prepare: every stage done\n{progress_table(plan)}")


def _run_processes(plan: StagedPlan, stage: str, pending: list[int], workers: int) -> None:
    """`python -m glm46.data.staged DIR --run STAGE INDEX` for each pending task, `workers` at a time, a new one as soon
    as any ends; each task's output in `<work>/logs/<stage>-<index>.log` (its last line is in a failure's message; a
    ConfigError or EmptyDatasetError is raised as itself)."""
    logs = plan.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    queue, running, failures = list(pending), {}, []
    while queue or running:
        while queue and len(running) < workers:
            index = queue.pop(0)
            command = [sys.executable, "-m", "glm46.data.staged", plan.output_dir, "--run", stage, str(index)]
            with open(logs / f"{stage}-{index}.log", "w") as log_file:
                running[index] = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
        time.sleep(0.05)
        for index, process in list(running.items()):
            if process.poll() is None:
                continue
            del running[index]
            if process.returncode:
                printed = (logs / f"{stage}-{index}.log").read_text(errors="replace").strip()
                failures.append((index, printed, logs / f"{stage}-{index}.log", process.returncode))
    failures.sort()
    for _, printed, _, _ in failures:
        if verdict := verdict_in(printed):
            raise verdict  # rerunning cannot help: said as itself, before any task that merely crashed
    if failures:
        index, printed, path, code = failures[0]
        raise _failed(plan, stage, index, f"{printed.splitlines()[-1] if printed else f'exit {code}'} ({path})")


def submit_slurm(plan: StagedPlan, executor, sbatch: dict) -> list[dict]:
    """Each stage's unfinished tasks as one job array that starts when the one before it has ended well (afterok;
    `sbatch`: the cluster's other flags). An earlier submission's jobs that have not ended are cancelled first,
    so two never write the same folders."""
    record = plan.work / "slurm_jobs.json"
    if record.is_file():
        earlier = [job["array"] for job in json.loads(record.read_text())]
        subprocess.run(["scancel", *earlier], check=False, capture_output=True)
    submitted, previous = [], None
    for stage in plan.stages:
        pending = plan.pending(stage)
        if not pending:
            continue
        dependency = {"dependency": f"afterok:{previous}", "kill-on-invalid-dep": "yes"} if previous else {}
        executor.update_parameters(
            slurm_job_name=f"glm46-prepare-{stage}", slurm_additional_parameters=dict(sbatch) | dependency
        )
        jobs = executor.map_array(run_task, [plan.output_dir] * len(pending), [stage] * len(pending), pending)
        previous = jobs[0].job_id.split("_")[0]
        submitted.append({"stage": stage, "array": previous, "tasks": pending, "jobs": jobs})
    record.write_text(json.dumps([{k: v for k, v in s.items() if k != "jobs"} for s in submitted], indent=2))
    return submitted


def wait_slurm(plan: StagedPlan, submitted: list[dict]) -> None:
    """Block until the last stage has ended; a failed task raises StageFailedError (its log path in the message), or
    the ConfigError or EmptyDatasetError it raised."""
    for stage in submitted:
        for index, job in zip(stage["tasks"], stage["jobs"]):
            try:
                job.result()
            except Exception as error:  # noqa: BLE001 - submitit's FailedJobError / UncompletedJobError
                failed = _failed(plan, stage["stage"], index, f"{error} (log {job.paths.stdout})")
                raise verdict_in(str(error)) or failed from None
