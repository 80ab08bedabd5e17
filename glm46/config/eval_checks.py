"""What an evaluation needs of the rest of the run, checked at composition: a local copy of each of lm-eval's
benchmarks it names (glm46.eval.benchmarks)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig


def check_benchmarks(cfg: DictConfig) -> None:
    """A composition that evaluates (task=eval, or a training run with eval.after_train) names only benchmarks whose
    local copies are there (glm46's own tasks and include_path's are checked when they are written)."""
    if cfg.task not in ("eval", "train") or (cfg.task == "train" and not cfg.eval.after_train):
        return
    from glm46.eval.benchmarks import local_sources  # lm-eval's index: only for an evaluation

    settings = cfg.eval
    names = [name for name in settings.tasks if not str(name).startswith("glm46")]
    own = [p.stem for p in Path(settings.include_path).rglob("*.yaml")] if settings.get("include_path") else []
    local_sources(names, settings.get("benchmark_dir"), own)
