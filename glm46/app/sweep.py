"""What a run and a sweep leave behind for `python -m glm46.compare` (the files: glm46.run_files).

- `<run dir>/state.json`, written by the Hydra callback RunState (hydra.callbacks in conf/config.yaml) when the job
  starts and when it ends, from the first rank only. A process killed outright (SIGKILL, a lost node) never
  writes its end: the reader then asks Slurm (sacct) or, on the same host, whether the process lives.
- `<sweep dir>/sweep.json`, every member a sweep will run, written before any of them starts (by RunState for a
  local multirun, by the Slurm launcher once the array is queued), so that a member that never started or died
  early is listed, not dropped.

A local multirun also rewrites the sweep's summary (glm46.reports.sweep_summary) each time a member ends, so that the
summary is complete once the last one has ended, also when a member failed (Hydra then raises and skips
on_multirun_end).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from glm46.run_files import STATE_FILE, SWEEP_FILE, read_json, write_json, write_manifest

log = logging.getLogger(__name__)
LOCAL_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID")  # what Lightning reads for the global rank
SUMMARIZED_TASKS = ("train", "eval")  # the tasks with outcomes (metrics.csv, eval/results.json)


def first_rank() -> bool:
    """Whether this process is rank 0 (or the only one): read from the environment, as at job start no process
    group exists yet."""
    return all(os.environ.get(name, "0") == "0" for name in RANK_VARIABLES)


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The jobs Hydra's basic sweeper makes of a command line's overrides (`optim=muon,adamw seed=0,1`: 4), in its
    order, which is the order of the members' numbers."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    (batch,) = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return batch


def job_error(job_return: JobReturn) -> str:
    """The failed job's exception as its last traceback line, as a person would quote it."""
    error = job_return._return_value
    if not isinstance(error, BaseException):
        return str(error)
    return "".join(traceback.format_exception_only(type(error), error)).strip()


class RunState(Callback):
    """Writes state.json into every run directory (see the module docstring) and, in a local multirun, the sweep's
    manifest at its start and its summary after each member."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.launcher._target_ != LOCAL_LAUNCHER:
            return  # the Slurm launcher writes its own, with the job ids
        jobs = sweep_jobs(list(config.hydra.overrides.task))
        members = [{"dir": str(number), "overrides": job, "job_id": None} for number, job in enumerate(jobs)]
        write_manifest(Path(config.hydra.sweep.dir), members)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not first_rank():
            return
        from glm46.lit.callbacks.preemption import slurm_job_id

        state = {
            "state": "running",
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "job_id": slurm_job_id(),
            "started": time.time(),
        }
        write_json(Path(config.hydra.runtime.output_dir) / STATE_FILE, state)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not first_rank():
            return
        run_dir = Path(config.hydra.runtime.output_dir)
        state = read_json(run_dir / STATE_FILE) or {}
        if job_return.status == JobStatus.FAILED:
            state.update(state="failed", error=job_error(job_return))
        else:
            result = job_return._return_value
            interrupted = isinstance(result, dict) and result.get("interrupted_at") is not None
            state.update(state="interrupted" if interrupted else "completed")
        state["ended"] = time.time()
        write_json(run_dir / STATE_FILE, state)
        local_sweep = config.hydra.mode.name == "MULTIRUN" and config.hydra.launcher._target_ == LOCAL_LAUNCHER
        if local_sweep and config.task in SUMMARIZED_TASKS:
            self.summarize(Path(config.hydra.sweep.dir), run_dir, state)

    @staticmethod
    def summarize(sweep_dir: Path, run_dir: Path, state: dict) -> None:
        """One line for the member that ended; the sweep's summary (files, and the tables once it is the last)."""
        from glm46.reports.sweep_summary import summarize_sweep

        log.info(f"member {run_dir.name}: {state['state']} -> {run_dir}")
        manifest = read_json(sweep_dir / SWEEP_FILE) or {"members": []}
        last = run_dir.name == (manifest["members"][-1]["dir"] if manifest["members"] else run_dir.name)
        summarize_sweep(sweep_dir, show=last)
