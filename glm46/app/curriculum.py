"""`train` through a curriculum in one run: the default `python run.py` (experiment=toy_recipe_tools) trains the
toy GLM curriculum stage by stage, on the embedded corpus prepared first (glm46.app.preparation).

An experiment lists its earlier stages under `stages` (name -> command-line overrides, e.g.
`[data=embedded_shards, phase=toy_pretrain1]`). Each is composed like `python run.py <its overrides>
<this run's overrides>`, validated before anything trains, and trained with its own Trainer in
`<run dir>/stages/<name>/`, a run directory of its own (.hydra/, checkpoints/, metrics.csv, plots, hf/),
starting from the previous stage's final weights, its `hf/` export (the first from `init_from`; a stage's
`last.ckpt` can be older than its last step: Lightning writes it at checkpoint intervals). The composition
itself is the last stage: it trains in the run directory from the last earlier stage's weights, so the
run directory holds what any run's does. With `ckpt_path=last`, stages that finished (their hf/ exists)
are skipped and the first unfinished one resumes from its newest checkpoint.

Stages run in one process: for a multi-process (DDP, Slurm) job, run each stage as its own job with
`init_from`, as README's "Curriculum" section shows.
"""

from __future__ import annotations

import csv
import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from glm46.app.train import train
from glm46.config.checks import validate
from glm46.eval import summarize
from glm46.logs import rank_zero_logger
from glm46.modules import GLM46Config
from glm46.reports.plots import plot_curriculum

log = rank_zero_logger(__name__)


@contextmanager
def _output_dir(path: Path):
    """Point `${hydra:runtime.output_dir}` (checkpoints, loggers, train's run directory) at `path`."""
    runtime = HydraConfig.instance().cfg.hydra.runtime
    previous = runtime.output_dir
    with read_write(runtime):
        runtime.output_dir = str(path)
    try:
        yield
    finally:
        with read_write(runtime):
            runtime.output_dir = previous


def compose_stage(overrides: list[str], run_overrides: list[str]) -> DictConfig:
    """The stage's composition: its overrides, then this run's (which apply to every stage)."""
    cfg = compose(config_name="config", overrides=[*overrides, *run_overrides], return_hydra_config=True)
    with open_dict(cfg):
        cfg.stages = None
    return cfg


def _save_hydra_dir(cfg: DictConfig, stage_dir: Path, overrides: list[str]) -> DictConfig:
    """Write `.hydra/{config,hydra,overrides}.yaml` as Hydra does for a run; return cfg without its hydra node."""
    hydra_node = cfg.hydra
    with open_dict(cfg):
        del cfg["hydra"]
    with read_write(hydra_node), open_dict(hydra_node):
        hydra_node.runtime.output_dir = hydra_node.run.dir = str(stage_dir)
    (stage_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, stage_dir / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": hydra_node}), stage_dir / ".hydra" / "hydra.yaml")
    OmegaConf.save(OmegaConf.create(list(overrides)), stage_dir / ".hydra" / "overrides.yaml")
    return cfg


def _loss_summary(run_dir: Path) -> str:
    """'train/loss first -> last, val/loss first -> last' from a run's metrics.csv."""
    if not (run_dir / "metrics.csv").is_file():
        return "no metrics"
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    parts = []
    for name in ("train/loss", "val/loss"):
        values = [float(r[name]) for r in rows if r.get(name)]
        if values:
            parts.append(f"{name} {values[0]:.2f} -> {values[-1]:.2f}")
    return ", ".join(parts) or "no losses"


def interval(accuracy: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of an accuracy measured on n samples (sound near 0 and 1, unlike p +- z SE)."""
    n = max(n, 1)
    center = (accuracy + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n))
    return max(center - half, 0.0), min(center + half, 1.0)  # clamped: at 0 or 1 rounding may step past them


SKILLS = {  # name -> (its lm-eval task, the 0/1 metric of each prompt)
    "arithmetic": ("glm46_arithmetic", "exact_match"),
    "tool_arithmetic": ("glm46_tool_arithmetic", "exact_match"),
    "tool_calls": ("glm46_tool_arithmetic", "tool_calls"),  # whether the episode called the tool at all
}


def outcomes(run_dir: Path, task: str, metric: str = "exact_match") -> dict[int, float]:
    """Each held-out prompt's 0/1 metric (doc_id -> value) in a generated task, from lm-eval's samples file."""
    path = run_dir / "eval" / f"samples_{task}.jsonl"
    if not path.is_file():
        return {}
    return {s["doc_id"]: float(s[metric]) for s in map(json.loads, path.read_text().splitlines())}


def paired_change(before: dict[int, float], after: dict[int, float], z: float = 1.96) -> tuple[float, float, float]:
    """The change in accuracy on the same prompts, with the 95% interval of a paired difference (the prompts both
    stages got right or wrong cancel; only the ones that changed count): (change, low, high)."""
    shared = sorted(before.keys() & after.keys())
    n = max(len(shared), 1)
    gained = sum(after[i] > before[i] for i in shared)
    lost = sum(after[i] < before[i] for i in shared)
    change = (gained - lost) / n
    half = z * math.sqrt(max(gained + lost - (gained - lost) ** 2 / n, 0.0)) / n
    return change, change - half, change + half


def skill_table(scores: dict[str, dict[str, float]]) -> str:
    """Rows = stages; columns = each skill's held-out share (greedy) with its 95% interval, the multiple-choice
    accuracy and each domain's bits per byte (lower is better)."""
    domains = sorted({k.split("/")[0].removeprefix("glm46_ppl_") for s in scores.values() for k in s if "_ppl_" in k})
    header = ["stage", *(f"{skill} (95% CI)" for skill in SKILLS), "arith. MC acc", *(f"{d} bpb" for d in domains)]

    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    rows = []
    for stage, score in scores.items():
        row = [stage]
        for task, metric in SKILLS.values():
            accuracy, n = score.get(f"{task}/{metric}"), int(score.get(f"{task}/n", 0))
            low, high = interval(accuracy or 0.0, n)
            row.append("-" if accuracy is None else f"{accuracy:.3f} [{low:.3f}, {high:.3f}] n={n}")
        row.append(number(score.get("glm46_arithmetic_mc/acc")))
        rows.append(row + [number(score.get(f"glm46_ppl_{d}/bits_per_byte")) for d in domains])
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [header, *rows]]
    return "\n".join([lines[0], "-+-".join("-" * w for w in widths), *lines[1:]])


def report_skills(run_dir: Path, stages: list[tuple[str, Path]]) -> None:
    """The table of every stage's evaluation (each stage's eval/results.json, lm-eval's format), each skill's paired
    change from stage to stage, and curriculum.png, when the stages were evaluated (eval.after_train)."""
    scores = {
        name: summarize(json.loads((where / "eval" / "results.json").read_text()))
        for name, where in stages
        if (where / "eval" / "results.json").is_file()
    }
    if not scores:
        return
    log.info("skills per stage (lm-eval on held-out data):\n" + skill_table(scores))
    skills = {}
    for skill, (task, metric) in SKILLS.items():
        evaluated = [(name, outcomes(where, task, metric)) for name, where in stages if name in scores]
        for (first, before), (second, after) in zip(evaluated, evaluated[1:]):
            if before and after:
                change, low, high = paired_change(before, after)
                log.info(f"{skill} {first} -> {second}: {change:+.3f} (paired 95% CI [{low:+.3f}, {high:+.3f}])")
        measured = {name: score for name, score in scores.items() if f"{task}/{metric}" in score}
        if measured:
            skills[skill] = {
                name: (score[f"{task}/{metric}"], interval(score[f"{task}/{metric}"], int(score[f"{task}/n"])))
                for name, score in measured.items()
            }
    log.info(f"wrote {plot_curriculum(stages, skills, run_dir / 'curriculum.png')}")


def train_stages(cfg: DictConfig, config: GLM46Config) -> dict:
    """Train cfg's earlier `stages` in order (a stage set to null is skipped), then cfg itself, each from the previous
    one's last checkpoint."""
    stages = {name: list(overrides) for name, overrides in (cfg.get("stages") or {}).items() if overrides is not None}
    if not stages:
        return train(cfg, config)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_overrides = list(HydraConfig.get().overrides.task)
    composed = {name: compose_stage(overrides, run_overrides) for name, overrides in stages.items()}
    configs = {name: validate(stage_cfg) for name, stage_cfg in composed.items()}  # all, before any training
    init_from, report = cfg.init_from, []
    for name, stage_cfg in composed.items():
        stage_dir = run_dir / "stages" / name
        if cfg.ckpt_path is not None and (stage_dir / "hf" / "config.json").is_file():
            log.info(f"stage {name}: finished before, skipped ({stage_dir})")
        else:
            log.info(f"stage {name}: {' '.join(stages[name])} -> {stage_dir}")
            with open_dict(stage_cfg):
                stage_cfg.init_from = None if init_from is None else str(init_from)
            stage_cfg = _save_hydra_dir(stage_cfg, stage_dir, stages[name] + run_overrides)
            started = time.time()
            with _output_dir(stage_dir):
                result = train(stage_cfg, configs[name])
            if not (stage_dir / "hf" / "config.json").is_file():
                log.info(f"stage {name} stopped before its end: resume with hydra.run.dir={run_dir} ckpt_path=last")
                return result
            report.append((name, time.time() - started, stage_dir, stage_cfg.init_from))
        init_from = stage_dir / "hf"
    with open_dict(cfg):
        cfg.init_from = str(init_from)
    started = time.time()
    metrics = train(cfg, config)
    report.append((str(cfg.phase.get("name", "final")), time.time() - started, run_dir, cfg.init_from))
    log.info(
        "curriculum:\n"
        + "\n".join(f"  {name:<24} {seconds:6.0f} s  {_loss_summary(where)}" for name, seconds, where, _ in report)
    )
    report_skills(run_dir, [(name, where) for name, _, where, _ in report])
    (run_dir / "curriculum.json").write_text(
        json.dumps(
            [
                {"stage": name, "seconds": round(seconds, 1), "run_dir": str(where), "init_from": source}
                for name, seconds, where, source in report
            ],
            indent=2,
        )
    )
    return metrics
