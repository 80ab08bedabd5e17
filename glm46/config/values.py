"""The values of a composition, read and checked one key at a time: what must be set (`???`), numbers at least 1,
choices from a list, interpolations resolved now so that an error names its key; and the composed model config."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from glm46.errors import ConfigError
from glm46.modules import GLM46Config

# Keys each task reads; a missing (`???`) value among them is refused. `train` and `prepare` read everything
# their composition holds.
READS = {
    "estimate": ("model",),
    "plan": ("model", "optim", "phase", "parallelism", "cluster", "data.seq_len", "data.batch_size"),
    "dryrun": ("model", "optim", "phase", "parallelism", "cluster", "data.seq_len", "data.batch_size"),
}


AT_LEAST_ONE = (
    "data.batch_size",
    "data.seq_len",
    "trainer.max_steps",
    "trainer.accumulate_grad_batches",
    "cluster.num_nodes",
    "cluster.devices",
    "optim.optimizer.ns_steps",
)


# Lightning's accepted `precision` values (lightning.fabric.connector._PRECISION_INPUT).
PRECISIONS = (
    "64-true",
    "32-true",
    "16-true",
    "16-mixed",
    "bf16-true",
    "bf16-mixed",
    "transformer-engine",
    "transformer-engine-float16",
    "64",
    "32",
    "16",
    "bf16",
)


CHOICES = {  # key -> (allowed values, what the message says about the key)
    "trainer.precision": (PRECISIONS, "{key}={value!r} is not one of Lightning's {choices}"),
    "optim.optimizer.ns_dtype": (
        ("bfloat16", "float16", "float32", "float64"),
        "{key}={value!r} (Muon's Newton-Schulz) is not one of {choices}",
    ),
}


def value_at(cfg: DictConfig, key: str):
    """The resolved value at `key` (None when absent); a resolver's error becomes a ConfigError naming the key."""
    try:
        return OmegaConf.select(cfg, key, throw_on_missing=False)
    except OmegaConfBaseException as error:
        raise ConfigError(f"{key}: " + str(error).splitlines()[0]) from None


def missing_keys(node: DictConfig, prefix: str = ""):
    """Full keys of the `???` values under `node`, without resolving any interpolation."""
    for key, value in node.items_ex(resolve=False):
        if not prefix and key == "hydra":  # Hydra's own node (a launcher's job config has it): filled at run time
            continue
        if OmegaConf.is_missing(node, key):
            yield f"{prefix}{key}"
        elif isinstance(value, DictConfig) and node[key] is not None:
            yield from missing_keys(value, f"{prefix}{key}.")


def refuse_missing(cfg: DictConfig) -> None:
    """Every `???` value the task reads, named, before any work (a job would otherwise fail after queueing)."""
    reads = READS.get(str(cfg.task))
    missing = sorted(
        k for k in missing_keys(cfg) if reads is None or any(k == r or k.startswith(f"{r}.") for r in reads)
    )
    if missing:
        raise ConfigError(
            f"{', '.join(missing)}: no value (???) for task={cfg.task}; set " + " ".join(f"{k}=..." for k in missing)
        )


def resolve(cfg: DictConfig, keys: tuple[str, ...]) -> None:
    """Resolve the interpolations and resolvers under `keys` now, so that an error names its key."""
    for key in keys:
        node = value_at(cfg, key)
        try:
            if OmegaConf.is_config(node):
                OmegaConf.to_container(node, resolve=True)
        except OmegaConfBaseException as error:
            raise ConfigError(str(error).splitlines()[0] + f" ({key}: {getattr(error, 'full_key', '')})") from None


def model_config(cfg: DictConfig) -> GLM46Config:
    """The validated GLM46Config of a composition (raises ConfigError naming the keys)."""
    try:
        return OmegaConf.to_object(cfg.model)
    except ConfigError as error:
        raise ConfigError(f"model: {error}") from None


def check_at_least_one(cfg: DictConfig, keys: tuple[str, ...] = AT_LEAST_ONE) -> None:
    for key in keys:
        value = value_at(cfg, key)
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value!r} must be an integer >= 1")


def check_choices(cfg: DictConfig) -> None:
    for key, (choices, message) in CHOICES.items():
        value = value_at(cfg, key)
        if value is not None and str(value) not in choices:
            raise ConfigError(message.format(key=key, value=value, choices=list(choices)))


def check_values(cfg: DictConfig, config: GLM46Config) -> None:
    check_at_least_one(cfg)
    check_choices(cfg)
