"""Refuse a composition that cannot run, before anything is queued or trained, naming the keys.

Types and key names are the schemas' (glm46/config/schema: Hydra refuses them while composing). What is
left here is what a type cannot say: values that must be set, ranges and choices, relations between keys
(divisibility, sequence length vs context, the dataset's domains, memory fit), each checked once.
The Slurm launcher runs `validate` on every job before `sbatch`; `run.py` before any task. The checks live beside
what they relate: `values.py` (single keys), `data_checks.py`, `layout_checks.py`, `training_checks.py`,
`export_checks.py`, `sample_checks.py`; CHECKS below is their order.
"""

from __future__ import annotations

from hydra.errors import CompactHydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from glm46.errors import ConfigError
from glm46.modules import GLM46Config

from .data_checks import check_data, check_prepare, check_vocabulary
from .eval_checks import check_benchmarks
from .export_checks import check_export, check_score, check_serve
from .layout_checks import (
    check_cluster,
    check_composed_layout,
    check_context_parallel_kernel,
    check_engine,
    check_memory,
)
from .peft_checks import check_peft
from .sample_checks import check_sample
from .training_checks import check_budget, check_checkpoints, check_recipe, check_training
from .values import check_values, model_config, refuse_missing, resolve


class Refused(CompactHydraException):
    """A ConfigError at the command line: Hydra prints its message alone, no traceback."""


RESOLVED_BEFORE_TRAINING = (
    "model",
    "optim",
    "schedule",
    "data",
    "phase",
    "trainer",
    "parallelism",
    "cluster",
    "global_batch_tokens",
)


# What `validate` checks after the model and the missing values, in order: (the groups a check relates, the tasks it
# applies to, the check). Each component checks its own arguments beside its class (built once in check_training);
# these are the relations between groups.
ALL, TRAIN = ("train", "estimate", "plan", "dryrun", "eval"), ("train",)


CHECKS = (
    ("data x init_from x model: one vocabulary", TRAIN, check_vocabulary),  # first: else its symptoms come first
    ("data x model x phase", ALL, check_data),
    ("cluster", ALL, check_cluster),
    ("parallelism x model x optimizer x cluster x data", ALL, check_composed_layout),
    ("parallelism x installed engines", ALL, check_engine),
    ("phase budget x trainer", TRAIN, lambda cfg, config: check_budget(cfg)),
    ("sizes and names", ALL, check_values),
    ("recipe x schedule x phase", ALL, lambda cfg, config: check_recipe(cfg)),
    ("every interpolation training reads", TRAIN, lambda cfg, config: resolve(cfg, RESOLVED_BEFORE_TRAINING)),
    ("optimizer x precision, components, RL", TRAIN, lambda cfg, config: check_training(cfg)),
    ("checkpoints read (init_from, ckpt_path)", TRAIN, lambda cfg, config: check_checkpoints(cfg)),
    ("peft x parallelism x precision", TRAIN, check_peft),
    ("memory per GPU x cluster", TRAIN, check_memory),
    ("context parallelism x accelerator", TRAIN, check_context_parallel_kernel),
    ("eval.tasks x eval.benchmark_dir", ALL, lambda cfg, config: check_benchmarks(cfg)),
)


def validate(cfg: DictConfig) -> GLM46Config:
    """Reject a composition that cannot run, before any work starts; return its model config (task=serve: the
    export's). An interpolation that does not resolve (a resolver reading a missing dataset) is refused as itself,
    naming its key."""
    try:
        return _validate(cfg)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None)
        message = str(error).splitlines()[0].removeprefix("ValueError raised while resolving interpolation: ")
        raise ConfigError(f"{key}: {message}" if key else message) from None


def _validate(cfg: DictConfig) -> GLM46Config:
    if cfg.task == "serve":  # reads the export and serve.*, not the composition's model or data
        return check_serve(cfg)
    if cfg.task == "export":  # likewise: the export and export.*
        return check_export(cfg)
    if cfg.task == "score":  # the reward model's export and score.*
        return check_score(cfg)
    if cfg.task == "sample":  # the sampling model's export, its prompts and sample.*
        return check_sample(cfg)
    refuse_missing(cfg)
    config = model_config(cfg)
    if cfg.task == "prepare":  # reads its source and the prepare settings only; the pipeline checks them
        if cfg.get("source") is None:
            raise ConfigError(
                "task=prepare reads `source`, and none is chosen: source=embedded|jsonl|chat|text|parquet"
            )
        check_prepare(cfg)
        return config
    for _, tasks, check in CHECKS:
        if str(cfg.task) in tasks:
            check(cfg, config)
    return config
