"""What an evaluation needs of the rest of the run, checked at composition: a local copy of each of lm-eval's
benchmarks it names (glm46.eval.benchmarks), and a sandbox for the code benchmarks' programs (glm46.sandbox)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from glm46.errors import ConfigError


def check_benchmarks(cfg: DictConfig) -> None:
    """A composition that evaluates (task=eval, or a training run with eval.after_train) names only benchmarks whose
    local copies are there; task=eval has a model or a server, and the prepared eval.dataset its own tasks are
    written from where it names them (a training run's may be prepared by an earlier stage; include_path's tasks
    are checked when they are written)."""
    if cfg.task not in ("eval", "train") or (cfg.task == "train" and not cfg.eval.after_train):
        return
    from glm46.eval.benchmarks import bundled_entry, local_sources  # lm-eval's index: only for an evaluation
    from glm46.eval.bfcl import GROUP, bfcl_names, check_bfcl
    from glm46.eval.code_tasks import is_code_task
    from glm46.eval.lm_eval_tasks import names_own, prepared
    from glm46.sandbox import KINDS, Sandbox

    settings = cfg.eval
    if cfg.task == "eval" and settings.model is None and settings.get("endpoint") is None:
        raise ConfigError(
            "eval.model: no model to evaluate; set eval.model=<a run directory or an HF directory>, or "
            "eval.endpoint=<a server's URL ending in /v1>"
        )
    if cfg.task == "eval" and names_own(settings.tasks) and not prepared(settings.dataset):
        raise ConfigError(
            f"eval.tasks={list(settings.tasks)} names glm46's own tasks, written from eval.dataset={settings.dataset}, "
            f"which is not a prepared dataset (no tokens/shards.json): prepare it with `python run.py task=prepare "
            f"source=embedded`, set eval.dataset, or name only benchmarks in eval.tasks"
        )
    names = [name for name in settings.tasks if not str(name).startswith("glm46")]
    own = [p.stem for p in Path(settings.include_path).rglob("*.yaml")] if settings.get("include_path") else []
    check_bfcl(names)
    own += bfcl_names(names) + [GROUP]
    local_sources(names, settings.get("benchmark_dir"), own)
    if settings.sandbox not in KINDS:
        raise ConfigError(f"eval.sandbox={settings.sandbox!r}: expected one of {list(KINDS)}")
    code = [name for name in names if name not in own and is_code_task(getattr(bundled_entry(name), "cfg", {}))]
    reason = Sandbox(settings.sandbox).check() if code and settings.sandbox != "none" else None
    if reason:
        raise ConfigError(
            f"eval.tasks: {', '.join(code)} run model-written programs, and no sandbox can run them here: {reason}; "
            "or run them unsandboxed with eval.sandbox=none"
        )
