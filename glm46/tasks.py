"""The tasks `run.py` dispatches to, by the `task` key of the composed config."""

from __future__ import annotations

from collections.abc import Callable

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from glm46.estimate import count_parameters, format_counts
from glm46.modules import ConfigError, GLM46Config


def model_config(cfg: DictConfig) -> GLM46Config:
    """The validated GLM46Config of a composition (raises ConfigError naming the keys)."""
    return OmegaConf.to_object(cfg.model)


def estimate(cfg: DictConfig) -> dict[str, int]:
    """Print the parameter counts of the composed model."""
    counts = count_parameters(model_config(cfg))
    name = HydraConfig.get().runtime.choices.get("model", "model") if HydraConfig.initialized() else "model"
    print(format_counts(name, counts))
    return counts


TASKS: dict[str, Callable[[DictConfig], object]] = {"estimate": estimate}


def validate(cfg: DictConfig) -> None:
    """Reject a composition that cannot run, before any work starts."""
    if cfg.task not in TASKS:
        raise ConfigError(f"task={cfg.task!r} is not one of {sorted(TASKS)}")
    try:
        model_config(cfg)
    except ConfigError as error:
        raise ConfigError(f"model: {error}") from None


def run_task(cfg: DictConfig) -> object:
    validate(cfg)
    return TASKS[cfg.task](cfg)
