"""What an evaluation needs of the rest of the run, checked at composition: a local copy of each of lm-eval's
benchmarks it names (glm46.eval.benchmarks), and a sandbox for the code benchmarks' programs (glm46.sandbox)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from glm46.errors import ConfigError


def check_benchmarks(cfg: DictConfig) -> None:
    """A composition that evaluates (task=eval, or a training run with eval.after_train) names only benchmarks whose
    local copies are there (glm46's own tasks and include_path's are checked when they are written)."""
    if cfg.task not in ("eval", "train") or (cfg.task == "train" and not cfg.eval.after_train):
        return
    from glm46.eval.benchmarks import bundled_entry, local_sources  # lm-eval's index: only for an evaluation
    from glm46.eval.bfcl import GROUP, bfcl_names, check_bfcl
    from glm46.eval.code_tasks import is_code_task
    from glm46.sandbox import KINDS, Sandbox

    settings = cfg.eval
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
