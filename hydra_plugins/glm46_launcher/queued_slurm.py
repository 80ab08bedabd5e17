"""Submission to Slurm that returns once the jobs are queued.

hydra-submitit-launcher's SlurmLauncher submits every point of a sweep as one job array and then
blocks until all of them finish; for an 80-day job the user needs the command back. QueuedSlurmLauncher
is that launcher with two changes: every job's composition is validated (glm46.config.checks.validate, which
checks it against the cluster) before anything is submitted, and it returns after submission,
printing the job ids, log paths and the squeue/scancel lines, unless `wait: true` (then it waits for the jobs and
writes the sweep's summary, glm46.reports.sweep_summary). A job array's manifest (glm46.run_files) lists its members.
When sbatch refuses the submission, the user gets one line (SlurmRefusedError) saying what was asked and what
Slurm answered.
"""

from __future__ import annotations

import contextlib
import io
import logging
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job
from hydra.errors import CompactHydraException
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf

log = logging.getLogger(__name__)
LOCAL_TASKS = {"plan", "estimate", "dryrun"}  # they spend nothing: no reason to queue them
UNJUDGED_FLAGS = ("--job-name=", "--output=", "--error=")  # names and log paths: not what Slurm refuses


class SlurmRefusedError(CompactHydraException):
    """sbatch refused the submission. Hydra prints a CompactHydraException as its message alone: the user
    needs what was asked and Slurm's answer, not submitit's traceback."""


class QueuedSlurmLauncher(SlurmLauncher):
    def __init__(self, wait: bool = False, env: dict | None = None, **params) -> None:
        super().__init__(**params)
        self.wait = wait
        exports = [f"export {key}={shlex.quote(str(value))}" for key, value in (env or {}).items()]
        self.params["setup"] = exports + list(self.params.get("setup") or [])

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        configs = [self.hydra_context.config_loader.load_sweep_config(self.config, list(o)) for o in job_overrides]
        if all(config.task in LOCAL_TASKS for config in configs):
            return [self.run_here(config) for config in configs]
        from glm46.config.checks import Refused, validate
        from glm46.errors import ConfigError

        for overrides, config in zip(job_overrides, configs):
            try:
                validate(config)
            except ConfigError as error:
                raise Refused(f"{' '.join(overrides) or '(no overrides)'}: {error}") from None

        if all(config.task == "prepare" and config.prepare.tasks > 1 for config in configs):
            return [self.submit_prepare(config, overrides) for config, overrides in zip(configs, job_overrides)]
        executor = self.executor()
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if configs[0].cluster.max_restarts > 0:
            setup, teardown = restart_lines(configs[0].cluster, sweep_dir)
            executor.update_parameters(slurm_setup=[*(self.params.get("setup") or []), *setup], slurm_teardown=teardown)
        arguments = [
            (
                list(overrides),
                "hydra.sweep.dir",
                initial_job_idx + i,
                f"job_id_for_{initial_job_idx + i}",
                Singleton.get_state(),
            )
            for i, overrides in enumerate(job_overrides)
        ]
        jobs = self.submit(executor, arguments)
        members_dir = record_sweep(jobs, job_overrides, sweep_dir)
        print(submission_report(jobs, job_overrides, sweep_dir, members_dir), flush=True)
        if self.wait:
            return self.wait_for(jobs, job_overrides, configs, members_dir)
        return [
            JobReturn(
                overrides=list(overrides),
                cfg=config,
                working_dir=str(sweep_dir),
                status=JobStatus.COMPLETED,
                _return_value=job.job_id,
            )
            for job, overrides, config in zip(jobs, job_overrides, configs)
        ]

    def wait_for(self, jobs: list, job_overrides: Sequence[Sequence[str]], configs: list, members_dir: Path | None):
        """`wait: true`: block until every job has ended, write the sweep's summary, and return each job's result (a
        failed job's as FAILED: Hydra then raises its error, after the summary is written)."""
        returns = []
        for job, overrides, config in zip(jobs, job_overrides, configs):
            try:
                returns.append(job.results()[0])
            except Exception as error:  # noqa: BLE001 - submitit's FailedJobError / UncompletedJobError: a failed job
                returns.append(
                    JobReturn(overrides=list(overrides), cfg=config, status=JobStatus.FAILED, _return_value=error)
                )
        if members_dir is not None:
            from glm46.reports.sweep_summary import summarize_sweep

            summarize_sweep(members_dir)
        return returns

    def __call__(self, *args, **kwargs) -> JobReturn:
        """Run the job inside its Slurm task. Hydra's run_job keeps the task's exception in the JobReturn, and the
        task would exit 0 with nothing logged: raised here, the traceback is in the log and the task exits non-zero,
        so `--kill-on-bad-exit` ends the other ranks at once and sacct says FAILED."""
        result = super().__call__(*args, **kwargs)
        if result.status == JobStatus.FAILED:
            result.return_value  # noqa: B018 (Hydra's accessor: it raises the job's exception, naming the overrides)
        return result

    def submit(self, executor, arguments: list) -> list:
        """executor.map_array, with a refused sbatch turned into one line. submitit echoes sbatch's stderr before
        it raises, which would repeat Slurm's answer: stderr is held during the call and passed on without it."""
        from submitit.core.utils import FailedJobError

        held = io.StringIO()
        try:
            with contextlib.redirect_stderr(held):
                return executor.map_array(self, *zip(*arguments))
        except FailedJobError as error:
            held = io.StringIO(held.getvalue().replace(f"{error}\n", "", 1))
            answer = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
            raise SlurmRefusedError(
                f"Slurm refused the job: {answer}; asked: {asked_flags(executor, len(arguments))} "
                f"(from cluster={self.config.hydra.runtime.choices.get('cluster')})"
            ) from None
        finally:
            sys.stderr.write(held.getvalue())

    def submit_prepare(self, config, overrides: Sequence[str]) -> JobReturn:
        """task=prepare over prepare.tasks > 1: its stages as dependent job arrays of one-CPU-node tasks
        (glm46.data.staged), each task with the cluster's cpus_per_task."""
        from glm46.app.preparation import submit_staged

        def executor(folder: Path):
            executor = self.executor(folder)
            executor.update_parameters(nodes=1, tasks_per_node=1, gpus_per_node=0)
            return executor

        threads = self.params.get("cpus_per_task") or 1
        sbatch = dict(self.params.get("additional_parameters") or {})
        report = submit_staged(config, executor, sbatch, threads, wait=self.wait)
        print(report, flush=True)
        return JobReturn(overrides=list(overrides), cfg=config, status=JobStatus.COMPLETED, _return_value=report)

    def executor(self, folder: Path | None = None):
        """The submitit executor of these parameters (what the parent launcher builds inline)."""
        import submitit

        executor = submitit.AutoExecutor(
            folder=folder or self.params["submitit_folder"],
            cluster="slurm",
            slurm_max_num_timeout=self.params.get("max_num_timeout", 0),
        )
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{
                key if key in shared else f"slurm_{key}": value
                for key, value in self.params.items()
                if key not in ("submitit_folder", "max_num_timeout")
            }
        )
        return executor

    def run_here(self, config) -> JobReturn:
        """Tasks that only look at the composition (plan, estimate, dryrun) run on the submitting machine."""
        return run_job(
            hydra_context=self.hydra_context,
            task_function=self.task_function,
            config=config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )


def restart_lines(cluster, sweep_dir: Path) -> tuple[list[str], list[str]]:
    """The batch script's first and last lines (glm46.app.restart): first, the record of an earlier attempt that Slurm
    ended for a lost node; last, a failed step requeues its job; both within the cluster's limits. The run directory
    is the job's, <sweep dir>/<job id> or <sweep dir>/<array job>/<task> (conf/launch/slurm.yaml)."""
    run_dir = f'{shlex.quote(str(sweep_dir))}/"${{SLURM_ARRAY_JOB_ID:+$SLURM_ARRAY_JOB_ID/$SLURM_ARRAY_TASK_ID}}"'
    where = f'run_dir={run_dir}; [ -n "$SLURM_ARRAY_JOB_ID" ] || run_dir={shlex.quote(str(sweep_dir))}/"$SLURM_JOB_ID"'
    restart = f"{shlex.quote(sys.executable)} -m glm46.app.restart"
    limits = (
        f'--run-dir "$run_dir" --max-restarts {cluster.max_restarts} '
        f"--without-progress {cluster.restarts_without_progress}"
    )
    setup = [where, f"{restart} --at-start {limits} || exit 1"]
    teardown = ["status=$?", where, f'{restart} --status "$status" {limits}', 'exit "$status"']
    return setup, teardown


def record_sweep(jobs: Sequence, job_overrides: Sequence[Sequence[str]], sweep_dir: Path) -> Path | None:
    """A job array's members run in `<sweep dir>/<array id>/<task>` (conf/launch/slurm.yaml): write that directory's
    manifest (glm46.run_files) so that a member that never starts is listed too; None for a job that is no array."""
    from glm46.run_files import write_manifest

    if "_" not in jobs[0].job_id:
        return None
    members_dir = sweep_dir / jobs[0].job_id.split("_")[0]
    members = [
        {"dir": job.job_id.split("_")[1], "overrides": list(overrides), "job_id": job.job_id}
        for job, overrides in zip(jobs, job_overrides)
    ]
    write_manifest(members_dir, members)
    return members_dir


def submission_report(
    jobs: Sequence, job_overrides: Sequence[Sequence[str]], sweep_dir: Path, members_dir: Path | None = None
) -> str:
    """What a user needs once the jobs are queued: ids, where the logs and runs go, how to watch, compare or cancel."""
    where = f"{members_dir}/<task>" if members_dir else f"{sweep_dir}/<job id>"
    lines = [f"submitted {len(jobs)} job(s) to Slurm; run directories {where}"]
    for job, overrides in zip(jobs, job_overrides):
        lines.append(f"  {job.job_id}: {' '.join(filter_overrides(overrides)) or '(no overrides)'}")
        lines.append(f"      log {job.paths.stdout}")
    array = jobs[0].job_id.split("_")[0]
    lines += [f"watch:  squeue -j {array}    sacct -j {array}", f"cancel: scancel {array}"]
    if members_dir:
        lines.append(f"compare when they end: python -m glm46.compare {members_dir}")
    return "\n".join(lines)


def asked_flags(executor, num_jobs: int) -> str:
    """The #SBATCH flags of the script submitit sent (a sweep's --array included), as one command line."""
    from submitit.slurm.slurm import _make_sbatch_string

    slurm = executor._executor
    array = {"map_count": num_jobs} if num_jobs > 1 else {}  # map_array submits one job alone, not as an array
    script = _make_sbatch_string(command="", folder=slurm.folder, **slurm.parameters, **array)
    flags = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]
    return " ".join(flag for flag in flags if not flag.startswith(UNJUDGED_FLAGS))
