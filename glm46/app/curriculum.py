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

A stage starts from the one before it unless its overrides say `init_from=@<stage>` (that earlier stage's hf/; the
composition itself likewise with `init_from: "@<stage>"`), so that several stages can branch from one (preference
learning's RLHF, PPO and DPO, each from SFT); `@<stage>` in any other override value is that stage's hf/ too
(`phase.reward.model=@reward_model`). Each evaluated stage's skills are compared with those of the stage it started
from.

Stages run in one process: for a multi-process (DDP, Slurm) job, run each stage as its own job with
`init_from`, as README's "Curriculum" section shows.
"""

from __future__ import annotations

import csv
import json
import time
from contextlib import contextmanager
from pathlib import Path

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from glm46.app.preparation import prepare_cached
from glm46.app.stage_graph import PRODUCTS, dependencies, format_waves, resolved, stage_kind, teachers, with_output
from glm46.app.train import train
from glm46.config.checks import validate
from glm46.data.cache import RECORD
from glm46.errors import ConfigError
from glm46.intervals import interval, paired_change
from glm46.logs import rank_zero_logger
from glm46.modules import GLM46Config
from glm46.reports.plots import plot_curriculum
from glm46.reports.skills import SKILLS, evaluations, skills_of
from glm46.sampling.rejection import emptiness, run_sample

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
    """The stage's composition: its overrides, then this run's (which apply to every stage), except that a stage
    trained whole (`peft=none`) takes none of the run's `peft.*` settings, which are for its adapter stage
    (experiment=toy_lora peft.r=32)."""
    if "peft=none" in overrides:
        run_overrides = [o for o in run_overrides if not o.lstrip("+~").startswith("peft.")]
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


def outcomes(run_dir: Path, task: str, metric: str = "exact_match") -> dict[int, float]:
    """Each held-out prompt's 0/1 metric (doc_id -> value) in a generated task, from lm-eval's samples file."""
    path = run_dir / "eval" / f"samples_{task}.jsonl"
    if not path.is_file():
        return {}
    return {s["doc_id"]: float(s[metric]) for s in map(json.loads, path.read_text().splitlines())}


def skill_table(scores: dict[str, dict[str, float]]) -> str:
    """Rows = stages; columns = each skill's held-out share (greedy) with its 95% interval (the skills some stage
    measured), the multiple-choice accuracy and each domain's bits per byte (lower is better)."""
    domains = sorted({k.split("/")[0].removeprefix("glm46_ppl_") for s in scores.values() for k in s if "_ppl_" in k})
    skills = {name: key for name, key in SKILLS.items() if any(f"{key[0]}/{key[1]}" in s for s in scores.values())}
    header = ["stage", *(f"{skill} (95% CI)" for skill in skills), "arith. MC acc", *(f"{d} bpb" for d in domains)]

    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    rows = []
    for stage, score in scores.items():
        row = [stage]
        for task, metric in skills.values():
            accuracy, n = score.get(f"{task}/{metric}"), int(score.get(f"{task}/n", 0))
            low, high = interval(accuracy or 0.0, n)
            row.append("-" if accuracy is None else f"{accuracy:.3f} [{low:.3f}, {high:.3f}] n={n}")
        row.append(number(score.get("glm46_arithmetic_mc/acc")))
        rows.append(row + [number(score.get(f"glm46_ppl_{d}/bits_per_byte")) for d in domains])
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [header, *rows]]
    return "\n".join([lines[0], "-+-".join("-" * w for w in widths), *lines[1:]])


def report_reward_models(stages: list[tuple[str, Path, str | None]]) -> None:
    """Each reward model stage's pairwise accuracy on its held-out pairs (its score.json: glm46.rl.score), and each one
    trained on shuffled labels (data.shuffle_labels, the control) against the others on the same pairs."""
    scored = {name: where for name, where, _ in stages if (where / "score.json").is_file()}
    results = {name: json.loads((where / "score.json").read_text()) for name, where in scored.items()}
    for name, result in results.items():
        (low, high), n, accuracy = result["ci95"], result["n"], result["pairwise_accuracy"]
        log.info(f"{name} pairwise_accuracy: {accuracy:.3f} (95% CI [{low:.3f}, {high:.3f}]) n={n}")
    controls = [name for name, where in scored.items() if OmegaConf.load(where / ".hydra" / "config.yaml").data.get(
        "shuffle_labels")]  # fmt: skip
    for control in controls:
        for name, result in results.items():
            if name not in controls and len(result["correct"]) == len(results[control]["correct"]):
                before, after = dict(enumerate(results[control]["correct"])), dict(enumerate(result["correct"]))
                change, low, high = paired_change(before, after)
                log.info(
                    f"pairwise_accuracy {control} (shuffled labels) -> {name}: {change:+.3f} "
                    f"(paired 95% CI [{low:+.3f}, {high:+.3f}])"
                )


def compared_stages(stages: list[tuple[str, Path, str | None]], evaluated: set[str]) -> list[tuple[str, str]]:
    """(before, after) pairs of evaluated stages: each stage and the nearest evaluated stage it started from (its
    init_from, followed back through the stages that were not evaluated)."""
    by_export = {str(where / "hf"): name for name, where, _ in stages}
    parent = {name: by_export.get(str(start)) for name, _, start in stages}
    pairs = []
    for name, _, _ in stages:
        before = parent[name]
        while before is not None and before not in evaluated:
            before = parent[before]
        if name in evaluated and before is not None:
            pairs.append((before, name))
    return pairs


def taught_pairs(
    stages: list[tuple[str, Path, str | None]], taught: dict[str, list[str]], evaluated: set[str]
) -> list[tuple[str, str]]:
    """(before, after) pairs of evaluated stages for a stage taught by experts (`taught`: stage -> the stages whose
    samples it learnt from): each expert, and where the experts started (a cold start), unless the stage started there
    itself (compared_stages has that pair)."""
    exports = {str(where / "hf"): name for name, where, _ in stages}
    starts = {name: exports.get(str(start)) for name, _, start in stages}
    pairs = []
    for name, experts in taught.items():
        for before in dict.fromkeys([*experts, *(starts.get(expert) for expert in experts)]):
            if before is not None and before != starts.get(name) and {before, name} <= evaluated:
                pairs.append((before, name))
    return pairs


def report_skills(
    run_dir: Path,
    stages: list[tuple[str, Path, str | None]],
    taught: dict[str, list[str]] | None = None,
    compared: list[tuple[str, str]] = (),
) -> None:
    """The table of every stage's evaluation (each stage's eval/results.json, lm-eval's format), each skill's paired
    change from the stage it started from, from each stage whose samples it was trained on (`taught`: a unified
    model's experts) and from where those started, and between the `compared` (before, after) stages (an
    experiment's compare_stages), and curriculum.png, when the stages were evaluated (eval.after_train).
    stages: (name, run directory, init_from) in order."""
    report_reward_models(stages)
    scores = evaluations([(name, where) for name, where, _ in stages])
    if not scores:
        return
    log.info("skills per stage (lm-eval on held-out data):\n" + skill_table(scores))
    pairs = compared_stages(stages, set(scores))
    pairs += taught_pairs(stages, taught or {}, set(scores))
    pairs += [pair for pair in compared if set(pair) <= set(scores)]
    for skill, (task, metric) in SKILLS.items():
        evaluated = {name: outcomes(where, task, metric) for name, where, _ in stages if name in scores}
        for first, second in pairs:
            before, after = evaluated[first], evaluated[second]
            if before and after:
                change, low, high = paired_change(before, after)
                log.info(f"{skill} {first} -> {second}: {change:+.3f} (paired 95% CI [{low:+.3f}, {high:+.3f}])")
    log.info(f"wrote {plot_curriculum([(n, w) for n, w, _ in stages], skills_of(scores), run_dir / 'curriculum.png')}")


def run_stage(kind: str, cfg: DictConfig, config: GLM46Config) -> object:
    """One stage in its directory (Hydra's output directory): train it, sample (glm46.sampling) or prepare its
    dataset."""
    if kind == "sample":
        return run_sample(cfg.sample, cfg.seed)
    if kind == "prepare":
        return prepare_cached(cfg.source, cfg.prepare)
    return train(cfg, config)


def finished(kind: str, stage_dir: Path) -> bool:
    """Whether a stage's product is whole: an export's config, a sample's manifest, a dataset's preparation record."""
    made = stage_dir / PRODUCTS[kind]
    if kind == "sample":
        return Path(f"{made}.manifest.json").is_file()
    return (made / ("config.json" if kind == "train" else RECORD)).is_file()


def check_sampled(name: str, stage_dir: Path) -> None:
    """A sample stage that made nothing ends the graph there, with why: the stages after it would fail on an empty
    dataset, far from the cause."""
    manifest = Path(f"{stage_dir / PRODUCTS['sample']}.manifest.json")
    if (why := emptiness(manifest)) is not None:
        raise ConfigError(
            f"stage {name} sampled {why}; the stages after it need its output. Change its settings, delete "
            f"{stage_dir} and resume with ckpt_path=last"
        )


def train_stages(cfg: DictConfig, config: GLM46Config) -> dict:
    """Run cfg's earlier `stages` in order (a stage set to null is skipped; glm46.app.stage_graph: training, sampling
    and preparation stages), then train cfg itself, each training stage from the previous one's weights unless it
    names its own."""
    listed = {name: list(overrides) for name, overrides in (cfg.get("stages") or {}).items() if overrides is not None}
    if not listed:
        return train(cfg, config)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    # this run's overrides apply to every stage, and its config search path (a user's own config directory) too
    hydra_overrides = HydraConfig.get().overrides
    run_overrides = list(hydra_overrides.task) + [o for o in hydra_overrides.hydra if o.startswith("hydra.searchpath=")]
    kinds = {name: stage_kind(overrides) for name, overrides in listed.items()}
    final_name = str(cfg.get("final_stage") or cfg.phase.get("name", "final"))
    unknown = [name for pair in cfg.get("compare_stages") or [] for name in pair if name not in {*listed, final_name}]
    if unknown:
        raise ConfigError(f"compare_stages: {unknown} are not stages of this run ({[*listed, final_name]})")
    final = [f"init_from={cfg.init_from}"] if str(cfg.init_from).startswith("@") else []
    needs = dependencies(listed, final)
    stages = {
        name: with_output(kinds[name], resolved(overrides, run_dir, kinds), run_dir / "stages" / name)
        for name, overrides in listed.items()
    }
    log.info(format_waves(needs, kinds))
    branches = {name: any(o.startswith("init_from=") for o in overrides) for name, overrides in stages.items()}
    composed = {name: compose_stage(overrides, run_overrides) for name, overrides in stages.items()}
    # all validated before any runs, but a sample stage's inputs are made by the stages before it: checked then
    configs = {name: validate(c) if kinds[name] != "sample" else None for name, c in composed.items()}
    # the first training stage starts from init_from, unless it is the composition's own start (@stage)
    init_from = None if final else cfg.init_from
    report = []
    for name, stage_cfg in composed.items():
        stage_dir, kind = run_dir / "stages" / name, kinds[name]
        if cfg.ckpt_path is not None and finished(kind, stage_dir):
            log.info(f"stage {name}: finished before, skipped ({stage_dir})")
            saved = OmegaConf.load(stage_dir / ".hydra" / "config.yaml")  # where it started, for the report
            report.append((name, 0.0, stage_dir, saved.get("init_from"), kind))
        else:
            log.info(f"stage {name}: {' '.join(stages[name])} -> {stage_dir}")
            with open_dict(stage_cfg):
                if kind == "train" and not branches[name]:  # else its own init_from=@<stage>
                    stage_cfg.init_from = None if init_from is None else str(init_from)
            stage_cfg = _save_hydra_dir(stage_cfg, stage_dir, stages[name] + run_overrides)
            started = time.time()
            with _output_dir(stage_dir):
                result = run_stage(kind, stage_cfg, configs[name] or validate(stage_cfg))
            if not finished(kind, stage_dir):
                log.info(f"stage {name} stopped before its end: resume with hydra.run.dir={run_dir} ckpt_path=last")
                return result
            report.append((name, time.time() - started, stage_dir, stage_cfg.get("init_from"), kind))
        if kind == "sample":
            check_sampled(name, stage_dir)
        if kind == "train":
            init_from = stage_dir / "hf"
    with open_dict(cfg):
        cfg.init_from = resolved(final, run_dir, kinds)[0].partition("=")[2] if final else str(init_from)
    started = time.time()
    metrics = train(cfg, config)
    report.append((final_name, time.time() - started, run_dir, cfg.init_from, "train"))
    log.info(
        "curriculum:\n"
        + "\n".join(f"  {name:<24} {seconds:6.0f} s  {_loss_summary(where)}" for name, seconds, where, _, _ in report)
    )
    trained = [(name, where, start) for name, _, where, start, kind in report if kind == "train"]
    taught = {name: teachers(name if name in listed else "final", needs, kinds, listed) for name, _, _ in trained}
    report_skills(run_dir, trained, taught, [tuple(pair) for pair in cfg.get("compare_stages") or []])
    (run_dir / "curriculum.json").write_text(
        json.dumps(
            [
                {
                    "stage": name,
                    "kind": kind,
                    "seconds": round(seconds, 1),
                    "run_dir": str(where),
                    "init_from": source,
                    "needs": needs.get(name, needs.get("final")),
                }  # fmt: skip
                for name, seconds, where, source, kind in report
            ],
            indent=2,
        )
    )
    return metrics
