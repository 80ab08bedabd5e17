"""The tasks `run.py` dispatches to, by the `task` key of the composed config (glm46.config.schema.Task)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig

from glm46.app.curriculum import train_stages
from glm46.app.preparation import prepare_cached, prepare_estimate, prepare_once
from glm46.checkpoint import find_weights
from glm46.checkpoint.fp8 import export_fp8
from glm46.checkpoint.gguf_export import export_gguf
from glm46.config.checks import validate
from glm46.eval import evaluate, summarize
from glm46.logs import quiet_dependencies, rank_zero_logger
from glm46.modules import GLM46Config
from glm46.planning.counts import count_parameters, format_counts
from glm46.planning.export_size import export_bytes
from glm46.planning.plan import format_plan
from glm46.planning.sizing import composed_plan
from glm46.planning.timeline import format_timeline, off_the_clock, phase_compositions, timeline
from glm46.serve.command import engine_command, format_command, launch

log = rank_zero_logger(__name__)


def estimate(cfg: DictConfig, config: GLM46Config) -> dict[str, int]:
    """The parameter counts of the composed model."""
    counts = count_parameters(config)
    name = HydraConfig.get().runtime.choices.get("model", "model") if HydraConfig.initialized() else "model"
    sizes = export_bytes(config)
    names = {"bf16": "bf16", "fp8": "block FP8", "gguf_f16": "GGUF f16", "gguf_q8_0": "q8_0", "gguf_q4_k_m": "q4_k_m"}
    on_disk = ", ".join(f"{names[key]} {size / 1e9:,.2f} GB" for key, size in sizes.items())
    log.info(format_counts(name, counts) + f"\nexport on disk (task=export): {on_disk}")
    return counts | {f"export_bytes_{k}": v for k, v in sizes.items()}


def prepare_data(cfg: DictConfig, config: GLM46Config) -> dict:
    """Read the `source`, deduplicate, filter, tokenize and write a dataset folder with its manifest (reused while
    its fingerprint holds); prepare.dry: only the estimate of its time and storage."""
    if cfg.prepare.dry:
        return prepare_estimate(cfg.source, cfg.prepare)
    prepare_cached(cfg.source, cfg.prepare)
    return json.loads((Path(cfg.source.output_dir) / "manifest.json").read_text())


def plan_job(cfg: DictConfig, config: GLM46Config) -> dict:
    """The composed job's plan (glm46.planning.plan): parameters, FLOPs, tokens/s, days, cost, memory per GPU; then the
    recipe's timeline (glm46.planning.timeline), for a phase on the recipe's clock."""
    result, hardware, layout = composed_plan(cfg, config)
    log.info(format_plan(result, hardware, layout))
    if cfg.phase.name not in cfg.recipe.phases:  # SFT, RL: the recipe's phases are composed by their own experiments
        log.info(off_the_clock(cfg))
        return {**result, "timeline": []}
    rows = timeline(phase_compositions(cfg))
    log.info(format_timeline(rows, cfg.phase.name, HydraConfig.get().runtime.choices.get("recipe", "recipe")))
    return {**result, "timeline": rows}


def dryrun_job(cfg: DictConfig, config: GLM46Config) -> dict:
    """One rank of the composed job at its real world size on this CPU (glm46.planning.dryrun); no data, no GPU."""
    from glm46.planning.dryrun import check, dry_run, format_dry_run

    result, hardware, layout = composed_plan(cfg, config)
    run = dry_run(cfg, config, hardware, layout)
    memory = result["by_pipeline_rank"][run.coordinate[0]]  # the plan of the simulated rank's pipeline stage(s)
    log.info(format_dry_run(run, memory, hardware, layout))
    check(run, memory, hardware)
    return {"state": run.state, "planned": run.planned, "largest_gather": run.largest_gather}


def train(cfg: DictConfig, config: GLM46Config) -> dict:
    """Build the `source` dataset unless it is cached by fingerprint, then train the experiment's `stages`
    and the composition itself (glm46.app.curriculum)."""
    prepare_once(cfg)
    return train_stages(cfg, config)


def eval_model(cfg: DictConfig, config: GLM46Config) -> dict[str, float]:
    """lm-evaluation-harness on eval.model's weights, offline, or on the server at eval.endpoint (glm46.eval):
    results in <run dir>/eval/, metrics in the composition's loggers."""
    loggers = [instantiate(c) for c in cfg.logger.values() if c is not None]
    results = evaluate(cfg.eval, cfg.eval.model, Path(HydraConfig.get().runtime.output_dir), loggers)
    for logger in loggers:
        logger.finalize("success")
    return summarize(results)


def serve(cfg: DictConfig, config: GLM46Config) -> dict:
    """Print the engine command for serve.model's export (glm46.serve.command), then run it unless serve.dry."""
    settings = cfg.serve
    command = engine_command(settings, find_weights(settings.model))
    env = {str(k): str(v) for k, v in settings.env.items()}
    print(format_command(command, env), flush=True)
    if settings.dry:
        return {"command": command}
    return {"command": command, "returncode": launch(command, env)}


def export(cfg: DictConfig, config: GLM46Config) -> dict:
    """A quantized copy of export.model's HF directory in export.output: block FP8 (glm46.checkpoint.fp8) or GGUF
    for llama.cpp (glm46.checkpoint.gguf_export)."""
    settings = cfg.export
    source, output = find_weights(settings.model), Path(settings.output)
    if settings.format == "fp8":
        output = export_fp8(source, output, settings.block_size)
    else:
        output = export_gguf(source, output, str(settings.gguf_type))
    print(f"{str(settings.format).upper()} export: {output}", flush=True)
    return {"output": str(output)}


def score_pairs(cfg: DictConfig, config: GLM46Config) -> dict:
    """A reward model's pairwise accuracy on prepared preference pairs (glm46.rl.score), into <run dir>/score.json."""
    from glm46.rl.score import score

    return score(cfg.score, Path(HydraConfig.get().runtime.output_dir))


def sample(cfg: DictConfig, config: GLM46Config) -> dict:
    """Rejection sampling (glm46.sampling.rejection): sample.output and its manifest."""
    from glm46.sampling.rejection import run_sample

    return run_sample(cfg.sample, cfg.seed)


TASKS: dict[str, Callable[[DictConfig, GLM46Config], object]] = {
    "estimate": estimate,
    "plan": plan_job,
    "prepare": prepare_data,
    "train": train,
    "dryrun": dryrun_job,
    "eval": eval_model,
    "serve": serve,
    "export": export,
    "score": score_pairs,
    "sample": sample,
}


def run_task(cfg: DictConfig) -> object:
    quiet_dependencies()  # here, not in run.py: a Slurm job starts in submitit's process, not run.py's
    return TASKS[cfg.task](cfg, validate(cfg))
