"""The tasks `run.py` dispatches to, by the `task` key of the composed config."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from glm46.data.documents import Ledger
from glm46.data.prepare import READERS, prepare
from glm46.data.shards import EOS, write_shards
from glm46.data.tokenizer import GLMTokenizer, train_tokenizer
from glm46.estimate import count_parameters, format_counts
from glm46.lit.shard_data import PACKINGS
from glm46.modules import ConfigError, GLM46Config
from glm46.parallel.layout import Layout, layout_from_config, validate_layout
from glm46.plan import Hardware, format_plan, plan
from glm46.train import train


def model_config(cfg: DictConfig) -> GLM46Config:
    """The validated GLM46Config of a composition (raises ConfigError naming the keys)."""
    return OmegaConf.to_object(cfg.model)


def estimate(cfg: DictConfig, config: GLM46Config) -> dict[str, int]:
    """Print the parameter counts of the composed model."""
    counts = count_parameters(config)
    name = HydraConfig.get().runtime.choices.get("model", "model") if HydraConfig.initialized() else "model"
    print(format_counts(name, counts))
    return counts


def prepare_data(cfg: DictConfig, config: GLM46Config) -> dict:
    """Read the `data` sources, deduplicate, filter and write a dataset folder with its manifest. On a
    composition that trains (no `data.reader`), build its `auto_prepare` corpus, as `train` would first."""
    data = cfg.data
    if data.get("reader") is None and cfg.get("auto_prepare"):
        from glm46.curriculum import prepare_once  # glm46.curriculum imports this module's callers

        prepare_once(cfg, lambda settings: prepare_data(settings, config))
        return {}
    if data.get("reader") not in READERS:
        raise ConfigError(f"data.reader={data.get('reader')!r}: task=prepare reads one of {sorted(READERS)} "
                          f"(data=embedded, jsonl, text or parquet)")
    # A tokenizer of one's own is loaded (and refused if it cannot serve) before any work.
    own_tokenizer = load_tokenizer(cfg.prepare.tokenizer.path) if cfg.prepare.tokenizer.path else None
    ledger = Ledger()
    options = OmegaConf.to_container(data.options) if "options" in data else {}
    documents = READERS[data.reader](list(data.paths), ledger, data.default_domain, **options)
    manifest = prepare(documents, ledger, data.output_dir, OmegaConf.to_container(cfg.prepare.dedup),
                       instantiate(cfg.prepare.quality, _convert_="all"), cfg.prepare.num_workers)
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(manifest["dropped"].items())) or "none"
    print(f"{manifest['documents_in']} documents in, {manifest['documents_out']} out; dropped: {dropped}")

    output_dir = Path(data.output_dir)
    tokenizer = own_tokenizer or train_on_documents(cfg.prepare.tokenizer.vocab_size, output_dir / "documents")
    tokenizer.save(output_dir / "tokenizer.json")
    shards = write_shards(output_dir, tokenizer, num_threads=cfg.prepare.num_workers)
    tokens = sum(d["tokens"] for d in shards["domains"].values())
    print(f"{tokens:,} tokens ({tokenizer.vocab_size} vocabulary), fingerprint {shards['fingerprint']}")
    print(f"wrote {output_dir}/manifest.json, tokenizer.json, tokens/")
    return manifest


def load_tokenizer(path: str) -> GLMTokenizer:
    """The tokenizer.json at `path` (prepare.tokenizer.path), which must have the document-end token."""
    tokenizer = GLMTokenizer.from_file(path)
    if tokenizer.tokenizer.token_to_id(EOS) is None:
        raise ConfigError(f"prepare.tokenizer.path={path}: the tokenizer has no {EOS!r} token, which "
                          f"ends every document in the token shards")
    return tokenizer


def train_on_documents(vocab_size: int, documents_dir: Path) -> GLMTokenizer:
    """A byte-level BPE of `vocab_size` trained on the prepared documents."""
    def texts():
        for file in sorted(documents_dir.glob("*.jsonl")):
            with open(file) as f:
                for line in f:
                    yield json.loads(line)["text"]

    return GLMTokenizer(train_tokenizer(texts(), vocab_size))


def hardware_and_layout(cfg: DictConfig) -> tuple[Hardware, Layout]:
    cluster = cfg.cluster
    hardware = Hardware(cluster.num_nodes, cluster.devices, cluster.gpu.name, cluster.gpu.memory_gib,
                        cluster.gpu.bf16_tflops, cluster.mfu, cluster.price_per_gpu_hour)
    return hardware, layout_from_config(cfg.parallelism, hardware.world_size)


def composed_plan(cfg: DictConfig, config: GLM46Config) -> tuple[dict, Hardware, Layout]:
    """glm46.plan of the composed model, phase, layout and cluster."""
    hardware, layout = hardware_and_layout(cfg)
    optimizer = "muon" if cfg.optim.optimizer._target_.endswith("Muon") else "adamw"
    result = plan(config, layout, hardware, float(cfg.phase.tokens), cfg.data.seq_len, cfg.data.batch_size,
                  optimizer, cfg.parallelism.activation_checkpointing, cfg.parallelism.pipeline_parallel)
    return result, hardware, layout


def plan_job(cfg: DictConfig, config: GLM46Config) -> dict:
    """The composed job's plan (glm46.plan): parameters, FLOPs, tokens/s, days, cost, memory per GPU."""
    result, hardware, layout = composed_plan(cfg, config)
    print(format_plan(result, hardware, layout))
    return result


def dryrun_job(cfg: DictConfig, config: GLM46Config) -> dict:
    """One rank of the composed job at its real world size on this CPU (glm46.dryrun); no data, no GPU."""
    from glm46.dryrun import check, dry_run, format_dry_run

    result, hardware, layout = composed_plan(cfg, config)
    run = dry_run(cfg, config, hardware, layout)
    print(format_dry_run(run, result["memory"], hardware, layout))
    check(run, result["memory"], hardware)
    return {"state": run.state, "planned": run.planned, "largest_gather": run.largest_gather}


def train_curriculum(cfg: DictConfig, config: GLM46Config) -> dict:
    """`train`: first build the dataset of `auto_prepare` unless it is cached by fingerprint, then train through
    the experiment's `stages` and the composition itself (glm46.curriculum; the default run's toy curriculum)."""
    from glm46.curriculum import prepare_once, train_stages

    prepare_once(cfg, lambda settings: prepare_data(settings, config))
    return train_stages(cfg, config, train, validate)


TASKS: dict[str, Callable[[DictConfig, GLM46Config], object]] = {
    "estimate": estimate, "plan": plan_job, "prepare": prepare_data, "train": train_curriculum, "dryrun": dryrun_job,
}

RESOLVED_BEFORE_RUNNING = ("model", "optim", "data", "phase", "trainer", "parallelism", "cluster")


# Lightning's accepted `precision` values (lightning.fabric.connector._PRECISION_INPUT).
PRECISIONS = ("64-true", "32-true", "16-true", "16-mixed", "bf16-true", "bf16-mixed", "transformer-engine",
              "transformer-engine-float16", "64", "32", "16", "bf16", 64, 32, 16)
NS_DTYPES = ("bfloat16", "float16", "float32", "float64")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _prepared_domains(cfg: DictConfig) -> set[str] | None:
    """The domains of the prepared dataset at data.path (its tokens/shards.json), when it is on this machine and
    not one the run prepares itself (auto_prepare); None otherwise (an unreadable index is the DataModule's to
    report)."""
    data = cfg.data
    if "path" not in data or OmegaConf.is_missing(data, "path") or not data.path:
        return None
    auto = cfg.get("auto_prepare")
    if auto and Path(str(auto.get("output_dir"))).absolute() == Path(data.path).absolute():
        return None
    index = Path(data.path) / "tokens" / "shards.json"
    try:
        return set(json.loads(index.read_text())["domains"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def validate_data(cfg: DictConfig) -> None:
    """data.batch_size, data.seq_len, data.packing and data.mixture, where the data node has them."""
    data = cfg.data
    for key in ("batch_size", "seq_len"):
        if key in data and not _positive_int(data[key]):
            raise ConfigError(f"data.{key}={data[key]!r} must be an integer >= 1")
    if "packing" in data:
        if data.packing not in PACKINGS:
            raise ConfigError(f"data.packing={data.packing!r} (phase.packing) is not one of {list(PACKINGS)}")
        if data.packing == "truncate" and str(data.get("_target_", "")).endswith("SFTDataModule"):
            raise ConfigError("data.packing='truncate' with SFT data (data=sft, embedded_sft) would cut conversations "
                              "at random: SFT takes packing best_fit or pad")
    if data.get("mixture") is not None:
        mixture = OmegaConf.to_container(data.mixture, resolve=True)
        for domain, weight in mixture.items():
            if not (_number(weight) and weight >= 0):
                raise ConfigError(f"data.mixture.{domain}={weight!r} (phase.mixture) must be a number >= 0")
        if not sum(mixture.values()) > 0:
            raise ConfigError(f"data.mixture={mixture} (phase.mixture) gives no domain a positive weight")
        domains = _prepared_domains(cfg)
        unknown = sorted(set(mixture) - domains) if domains is not None else []
        if unknown:
            raise ConfigError(f"data.mixture (phase.mixture) names domains {unknown} that data.path={data.path} "
                              f"does not have (it has {sorted(domains)})")


def validate_training(cfg: DictConfig) -> None:
    """The trainer's step count, accumulation and precision, the phase's token budget and the optimizer."""
    trainer, phase = cfg.trainer, cfg.get("phase")
    if not _positive_int(trainer.get("accumulate_grad_batches")):
        raise ConfigError(f"trainer.accumulate_grad_batches={trainer.get('accumulate_grad_batches')!r} must be an "
                          f"integer >= 1")
    max_steps_from = str(OmegaConf.to_container(trainer, resolve=False).get("max_steps"))
    if phase is not None and "phase.tokens" in max_steps_from and _number(phase.get("tokens")):
        data, cluster = cfg.data, cfg.cluster
        per_step = phase.get("global_batch_tokens") or (data.batch_size * data.seq_len * trainer.accumulate_grad_batches
                                                       * cluster.num_nodes * cluster.devices)
        if phase.tokens < per_step:
            raise ConfigError(f"phase.tokens={phase.tokens} is less than one global batch of {per_step} tokens "
                              f"(trainer.max_steps={trainer.max_steps}): raise phase.tokens or lower the batch")
    if not _positive_int(trainer.get("max_steps")):
        raise ConfigError(f"trainer.max_steps={trainer.get('max_steps')!r} must be an integer >= 1 (the training "
                          f"data never ends, and the schedules are sized by it)")
    if trainer.get("precision") not in PRECISIONS:
        raise ConfigError(f"trainer.precision={trainer.get('precision')!r} is not one of Lightning's "
                          f"{[p for p in PRECISIONS if isinstance(p, str) and '-' in p]}")

    optimizer = cfg.optim.optimizer
    target = str(optimizer.get("_target_"))
    module, _, name = target.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name, None) if module else None
    except ImportError:
        found = None
    if found is None:
        raise ConfigError(f"optim.optimizer._target_={target!r} cannot be imported (optim=muon or adamw)")
    lr = optimizer.get("lr")
    if not (_number(lr) and lr > 0):
        raise ConfigError(f"optim.optimizer.lr={lr!r} must be a number > 0")
    min_lr = cfg.optim.get("min_lr", 0.0)
    if not (_number(min_lr) and 0 <= min_lr <= lr):
        raise ConfigError(f"optim.min_lr={min_lr!r} must be a number in [0, optim.optimizer.lr={lr}]")
    weight_decay = optimizer.get("weight_decay", 0.0)
    if not (_number(weight_decay) and weight_decay >= 0):
        raise ConfigError(f"optim.optimizer.weight_decay={weight_decay!r} must be a number >= 0")
    if "ns_dtype" in optimizer and optimizer.ns_dtype not in NS_DTYPES:
        raise ConfigError(f"optim.optimizer.ns_dtype={optimizer.ns_dtype!r} (Muon's Newton-Schulz) is not one of "
                          f"{list(NS_DTYPES)}")
    if "ns_steps" in optimizer and not _positive_int(optimizer.ns_steps):
        raise ConfigError(f"optim.optimizer.ns_steps={optimizer.ns_steps!r} must be an integer >= 1")
    if cfg.get("guard"):
        try:
            instantiate(cfg.guard)  # StepGuard checks its own settings
        except Exception as error:
            raise ConfigError(str(error.__cause__ or error).splitlines()[0]) from None


def validate(cfg: DictConfig) -> GLM46Config:
    """Reject a composition that cannot run, before any work starts; return its model config."""
    if cfg.task not in TASKS:
        raise ConfigError(f"task={cfg.task!r} is not one of {sorted(TASKS)}")
    try:
        config = model_config(cfg)
    except ConfigError as error:
        raise ConfigError(f"model: {error}") from None
    validate_data(cfg)
    seq_len = cfg.data.get("seq_len")
    if seq_len is not None and seq_len > config.max_position_embeddings:
        raise ConfigError(f"data.seq_len={seq_len} exceeds model.max_position_embeddings="
                          f"{config.max_position_embeddings}")
    cluster = cfg.cluster
    if cluster.scheduler == "slurm" and not cluster.get("partition"):
        raise ConfigError(f"cluster={cluster.name} submits to Slurm but cluster.partition is not set")
    for key in ("num_nodes", "devices"):
        if not _positive_int(cluster.get(key)):
            raise ConfigError(f"cluster.{key}={cluster.get(key)!r} must be an integer >= 1")
    world_size = cluster.num_nodes * cluster.devices
    validate_layout(cfg.parallelism, config, world_size, cfg.optim.get("optimizer"))
    for key in RESOLVED_BEFORE_RUNNING if cfg.task == "train" else ():  # a resolver's error names its key
        try:
            OmegaConf.to_container(cfg[key], resolve=True)
        except OmegaConfBaseException as error:
            raise ConfigError(str(error).splitlines()[0] + f" ({key}: {getattr(error, 'full_key', '')})") from None
    if cfg.task == "train":
        validate_training(cfg)
    if cfg.task == "train" and cluster.accelerator == "gpu":
        result = composed_plan(cfg, config)[0]
        if not result["fits"]:
            raise ConfigError(f"cluster={cluster.name}, parallelism={cfg.parallelism.name}: " + result["notes"][-1])
    return config


def run_task(cfg: DictConfig) -> object:
    return TASKS[cfg.task](cfg, validate(cfg))
