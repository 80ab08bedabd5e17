"""Submission to Slurm that returns once the jobs are queued.

hydra-submitit-launcher's SlurmLauncher submits every point of a sweep as one job array and then
blocks until all of them finish; for an 80-day job the user needs the command back. QueuedSlurmLauncher
is that launcher with two changes: every job's composition is validated (glm46.tasks.validate, which
checks it against the cluster) before anything is submitted, and it returns after submission,
printing the job ids, log paths and the squeue/scancel lines, unless `wait: true`.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Sequence
from pathlib import Path

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf

log = logging.getLogger(__name__)
LOCAL_TASKS = {"plan", "estimate", "dryrun"}  # they spend nothing: no reason to queue them


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
        if self.wait:
            return super().launch(job_overrides, initial_job_idx)
        from glm46.tasks import validate

        for overrides, config in zip(job_overrides, configs):
            try:
                validate(config)
            except Exception as error:
                raise type(error)(f"{' '.join(overrides) or '(no overrides)'}: {error}") from None

        executor = self.executor()
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        arguments = [(list(overrides), "hydra.sweep.dir", initial_job_idx + i, f"job_id_for_{initial_job_idx + i}",
                      Singleton.get_state()) for i, overrides in enumerate(job_overrides)]
        jobs = executor.map_array(self, *zip(*arguments))
        print(submission_report(jobs, job_overrides, str(self.config.hydra.sweep.dir)))
        return [JobReturn(overrides=list(overrides), cfg=config, working_dir=str(self.config.hydra.sweep.dir),
                          status=JobStatus.COMPLETED, _return_value=job.job_id)
                for job, overrides, config in zip(jobs, job_overrides, configs)]


    def executor(self):
        """The submitit executor of these parameters (what the parent launcher builds inline)."""
        import submitit

        executor = submitit.AutoExecutor(folder=self.params["submitit_folder"], cluster="slurm",
                                         slurm_max_num_timeout=self.params.get("max_num_timeout", 0))
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{
            key if key in shared else f"slurm_{key}": value for key, value in self.params.items()
            if key not in ("submitit_folder", "max_num_timeout")})
        return executor

    def run_here(self, config) -> JobReturn:
        """Tasks that only look at the composition (plan, estimate, dryrun) run on the submitting machine."""
        return run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=config,
                       job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")


def submission_report(jobs: Sequence, job_overrides: Sequence[Sequence[str]], sweep_dir: str) -> str:
    """What a user needs once the jobs are queued: ids, where the logs and runs go, how to watch or cancel."""
    lines = [f"submitted {len(jobs)} job(s) to Slurm; run directories under {sweep_dir}/<job id>"]
    for job, overrides in zip(jobs, job_overrides):
        lines.append(f"  {job.job_id}: {' '.join(filter_overrides(overrides)) or '(no overrides)'}")
        lines.append(f"      log {job.paths.stdout}")
    array = jobs[0].job_id.split("_")[0]
    lines += [f"watch:  squeue -j {array}    sacct -j {array}", f"cancel: scancel {array}"]
    return "\n".join(lines)
