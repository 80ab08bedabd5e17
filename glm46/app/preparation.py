"""`task=prepare` from a composition (its `source`), and the dataset a training run prepares first."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from glm46.data.cache import is_prepared, mark_prepared, prepare_fingerprint
from glm46.data.pipeline import run_preparation
from glm46.data.staged.cost import estimate, format_estimate
from glm46.data.staged.executors import submit_slurm, wait_slurm
from glm46.data.staged.work import StagedPlan, plan_for, progress_table
from glm46.errors import ConfigError
from glm46.logs import rank_zero_logger

log = rank_zero_logger(__name__)


def staged_plan(source: DictConfig, settings: DictConfig, threads: int = 1) -> StagedPlan:
    """The plan of preparing `source` over prepare.tasks tasks (glm46.data.staged), or a ConfigError naming what
    cannot run (no input, more tasks than input files, an output directory holding another preparation)."""
    source_, settings_ = (OmegaConf.to_container(node, resolve=True) for node in (source, settings))
    return plan_for(source_, settings_, threads)


def prepare_estimate(source: DictConfig, settings: DictConfig, threads: int = 1) -> dict:
    """Print (and return) the estimated time and storage of preparing `source`, and over several tasks the files
    each read task takes; nothing runs."""
    source_, settings_ = (OmegaConf.to_container(node, resolve=True) for node in (source, settings))
    result = estimate(source_, settings_, threads)
    lines = [format_estimate(result, settings.tasks, threads)]
    if settings.tasks > 1:
        plan = staged_plan(source, settings, threads)
        lines.append(f"  stages     {', '.join(f'{s} [{plan.size(s)}]' for s in plan.stages)}")
        for task, files in enumerate(plan.shards):
            lines.append(f"  read task {task + 1}: {len(files)} file(s), {files[0]} ... {files[-1]}")
    print("\n".join(lines), flush=True)
    return result


def prepare_source(source: DictConfig, settings: DictConfig) -> dict:
    """Prepare a `source` (source=embedded|jsonl|chat|text|parquet) with the `prepare` settings: in this process, or
    over prepare.tasks tasks on this machine, prepare.num_workers at a time (glm46.data.pipeline.run_preparation)."""
    return run_preparation(*(OmegaConf.to_container(node, resolve=True) for node in (source, settings)))


def prepare_cached(
    source: DictConfig, settings: DictConfig, prepare: Callable[[DictConfig, DictConfig], object] = prepare_source
) -> None:
    """Build the dataset of `source` with the `prepare` settings, unless its output_dir already holds it with the
    same fingerprint (glm46.data.cache). `prepare(source, settings)` builds it (tests pass their own)."""
    output_dir = Path(source.output_dir)
    fingerprint = prepare_fingerprint(
        OmegaConf.to_container(source, resolve=True), OmegaConf.to_container(settings, resolve=True)
    )
    if is_prepared(output_dir, fingerprint):
        log.info(f"dataset: {output_dir} (prepared, fingerprint {fingerprint})")
        return
    if int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))) > 1:
        raise ConfigError(
            f"source: {output_dir} is not prepared (fingerprint {fingerprint}) and this is one "
            f"of several processes: prepare it first with task=prepare, or run once in one process"
        )
    log.info(f"dataset: preparing {output_dir} (first use, or its sources or settings changed)")
    prepare(source, settings)
    mark_prepared(output_dir, fingerprint)


def prepare_once(cfg: DictConfig, prepare: Callable[[DictConfig, DictConfig], object] = prepare_source) -> None:
    """Before training: build the `source` dataset when the training data reads its output_dir (the default run),
    reused while its fingerprint holds. A run on another dataset (data.path elsewhere, or data=stdlib) never
    writes there, nor into its own."""
    if cfg.get("source") is None or "path" not in cfg.data:
        return
    if Path(cfg.data.path).absolute() == Path(cfg.source.output_dir).absolute():
        prepare_cached(cfg.source, cfg.prepare, prepare)


def submit_staged(config: DictConfig, executor_at: Callable, sbatch: dict, threads: int, wait: bool = False) -> str:
    """Queue the staged preparation of config.source on Slurm (its stages as dependent job arrays; only the tasks
    not yet finished), unless it is prepared already; `executor_at(folder)`: a submitit executor logging there.
    Returns what the user needs: the arrays, where the logs go, how to follow the progress."""
    source, settings = config.source, config.prepare
    fingerprint = prepare_fingerprint(
        OmegaConf.to_container(source, resolve=True), OmegaConf.to_container(settings, resolve=True)
    )
    if settings.dry:
        prepare_estimate(source, settings, threads)
        return "prepare.dry=true: nothing queued"
    if is_prepared(source.output_dir, fingerprint):
        return f"dataset: {source.output_dir} is prepared already (fingerprint {fingerprint}); nothing queued"
    plan = staged_plan(source, settings, threads)
    plan.save()
    logs = plan.work / "slurm"
    submitted = submit_slurm(plan, executor_at(logs / "%j"), sbatch)
    lines = [f"submitted the preparation of {plan.output_dir} over {plan.tasks} tasks: one job array per stage"]
    lines += [f"  {s['stage']:<10} {s['array']} ({len(s['tasks'])} task(s))" for s in submitted]
    lines += [
        f"logs:     {logs}/<job id>_<task>_log.out",
        f"progress: python -m glm46.data.staged {plan.output_dir}",
        f"cancel:   scancel {' '.join(s['array'] for s in submitted)}",
    ]
    if wait:
        wait_slurm(plan, submitted)
        lines.append(progress_table(plan))
    return "\n".join(lines)
