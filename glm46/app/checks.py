"""Refuse a composition that cannot run, before anything is queued or trained, naming the keys.

Types and key names are the schemas' (glm46/app/schema: Hydra refuses them while composing). What is
left here is what a type cannot say: values that must be set, ranges and choices, relations between keys
(divisibility, sequence length vs context, the dataset's domains, memory fit), each checked once.
The Slurm launcher runs `validate` on every job before `sbatch`; `run.py` before any task.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from hydra.errors import CompactHydraException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from glm46.app.resolvers import phase_steps, recipe_start
from glm46.checkpoint import find_weights
from glm46.checkpoint.engine_limits import serving_problems
from glm46.checkpoint.hub_config import config_from_hf
from glm46.data.windows import PACKINGS
from glm46.errors import ConfigError
from glm46.lit.sft_data import SFTDataModule, check_packing
from glm46.logs import rank_zero_logger
from glm46.modules import GLM46Config, cuda_kernels
from glm46.optim.muon import is_muon
from glm46.parallel.layout import Layout, model_problems
from glm46.planning.sizing import composed_layout, composed_plan
from glm46.rl.grpo_module import GRPOLitModule
from glm46.rl.prompts import PromptDataModule
from glm46.serve.llama_cpp import BUILD_SCRIPT as LLAMA_CPP_BUILD_SCRIPT
from glm46.serve.llama_cpp import llama_cpp_python

log = rank_zero_logger(__name__)


class Refused(CompactHydraException):
    """A ConfigError at the command line: Hydra prints its message alone, no traceback."""


# Keys each task reads; a missing (`???`) value among them is refused. `train` and `prepare` read everything
# their composition holds.
READS = {
    "estimate": ("model",),
    "plan": ("model", "optim", "phase", "parallelism", "cluster", "data.seq_len", "data.batch_size"),
    "dryrun": ("model", "optim", "phase", "parallelism", "cluster", "data.seq_len", "data.batch_size"),
}
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
    "data.packing": (PACKINGS, "{key}={value!r} (phase.packing) is not one of {choices}"),
}


def _get(cfg: DictConfig, key: str):
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
        node = _get(cfg, key)
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
        value = _get(cfg, key)
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value!r} must be an integer >= 1")


def check_choices(cfg: DictConfig) -> None:
    for key, (choices, message) in CHOICES.items():
        value = _get(cfg, key)
        if value is not None and str(value) not in choices:
            raise ConfigError(message.format(key=key, value=value, choices=list(choices)))


def _prepared_domains(cfg: DictConfig) -> set[str] | None:
    """The domains of the prepared dataset at data.path (its tokens/shards.json), when it is on this machine and
    not one the run prepares itself (its `source`); None otherwise (an unreadable index is the DataModule's to
    report)."""
    path = _get(cfg, "data.path")
    if not path:
        return None
    source = cfg.get("source")
    if source and Path(str(source.output_dir)).absolute() == Path(path).absolute():
        return None
    try:
        return set(json.loads((Path(path) / "tokens" / "shards.json").read_text())["domains"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_data(cfg: DictConfig, config: GLM46Config) -> None:
    data = cfg.data
    seq_len = data.get("seq_len")
    if seq_len is not None and seq_len > config.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len={seq_len} exceeds model.max_position_embeddings={config.max_position_embeddings}"
        )
    module = get_class(data._target_) if "_target_" in data else None
    if module is not None and issubclass(module, SFTDataModule):
        check_packing(data.packing)
    if data.get("mixture") is None:
        return
    mixture = OmegaConf.to_container(data.mixture, resolve=True)
    for domain, weight in mixture.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
            raise ConfigError(f"data.mixture.{domain}={weight!r} (phase.mixture) must be a number >= 0")
    if not sum(mixture.values()) > 0:
        raise ConfigError(f"data.mixture={mixture} (phase.mixture) gives no domain a positive weight")
    domains = _prepared_domains(cfg)
    unknown = sorted(set(mixture) - domains) if domains is not None else []
    if unknown:
        raise ConfigError(
            f"data.mixture (phase.mixture) names domains {unknown} that data.path={data.path} "
            f"does not have (it has {sorted(domains)})"
        )


def check_budget(cfg: DictConfig) -> None:
    """A step count derived from the phase's token budget (toy_stage, pretrain_phase1) spends at least one step."""
    trainer, phase, global_batch = cfg.trainer, cfg.phase, _get(cfg, "global_batch_tokens")
    if "phase.tokens" in str(OmegaConf.to_container(trainer, resolve=False)["max_steps"]):
        if phase.tokens < global_batch:
            raise ConfigError(
                f"phase.tokens={phase.tokens} is less than one global batch of "
                f"{global_batch} tokens (trainer.max_steps={trainer.max_steps}): raise "
                f"phase.tokens or lower the batch"
            )


def check_recipe(cfg: DictConfig) -> None:
    """The recipe's clock (conf/recipe) holds together, and the composed phase sits on it where the phases before it
    end: its tokens are the recipe's, its start is theirs, and the warm-ups end inside the first phase."""
    resolve(cfg, ("recipe", "schedule"))  # an error names its key
    recipe, phase, schedule = cfg.recipe, cfg.phase, cfg.schedule
    phases = dict(recipe.phases)
    if not phases or any(tokens < 1 for tokens in phases.values()):
        raise ConfigError(f"recipe.phases={phases}: the recipe needs at least one phase, each of >= 1 token")
    first, first_tokens = next(iter(phases.items()))
    for key in ("warmup_tokens", "batch_warmup_tokens"):
        if not 0 <= recipe[key] <= first_tokens:
            raise ConfigError(
                f"recipe.{key}={recipe[key]}: a warm-up longer than the recipe's first phase "
                f"(recipe.phases.{first}={first_tokens}) would go on into the next; it must end inside it"
            )
    if not 0 <= recipe.switch_tokens <= recipe.tokens:
        raise ConfigError(
            f"recipe.switch_tokens={recipe.switch_tokens} is not on the clock [0, recipe.tokens={recipe.tokens}]"
        )
    name = phase.name
    if name not in phases:
        return  # a clock of its own (SFT, RL, a quick run)
    if phase.tokens != phases[name]:
        raise ConfigError(
            f"phase.tokens={phase.tokens} but recipe.phases.{name}={phases[name]}: the phases after {name} start on "
            f"the recipe's clock where the recipe says it ends; set recipe.phases.{name}={phase.tokens} instead (in "
            f"every phase's job), or phase.tokens={phases[name]}"
        )
    start = recipe_start(recipe.phases, name)
    if schedule.start_tokens != start:
        before = list(phases)[: list(phases).index(name)]
        raise ConfigError(
            f"schedule.start_tokens={schedule.start_tokens} contradicts the phases before phase={name} on the "
            f"recipe's clock ({' + '.join(f'recipe.phases.{b}={phases[b]}' for b in before) or 'none'}): it starts at "
            f"{start}"
        )
    warmup = (cfg.get("callbacks") or {}).get("batch_size_warmup")
    ramp = None if warmup is None else warmup.tokens_per_step
    budget_steps = phase_steps(phase.tokens, ramp, start, cfg.global_batch_tokens, cfg.trainer.accumulate_grad_batches)
    if cfg.trainer.max_steps != budget_steps:
        log.warning(
            f"trainer.max_steps={cfg.trainer.max_steps}, but phase {name} has {phase.tokens:,} tokens on the recipe's "
            f"clock ({budget_steps} steps): the schedules stay on the clock, where the next phase starts at "
            f"{start + phase.tokens:,} tokens"
        )


def check_training(cfg: DictConfig) -> None:
    """The optimizer, precision against FSDP2's policy, the guard,
    and what `train` cannot train."""
    trainer = cfg.trainer
    optimizer = cfg.optim.optimizer
    try:
        get_class(optimizer._target_)
    except Exception:
        raise ConfigError(
            f"optim.optimizer._target_={optimizer._target_!r} cannot be imported (optim=muon or adamw)"
        ) from None
    if not optimizer.lr > 0:
        raise ConfigError(f"optim.lr={optimizer.lr!r} must be a number > 0 (the peak LR, which optim.optimizer.lr is)")
    if optimizer.weight_decay < 0:
        raise ConfigError(f"optim.optimizer.weight_decay={optimizer.weight_decay!r} must be a number >= 0")
    explicit = cfg.parallelism.mixed_precision
    if explicit.param_dtype and str(trainer.precision) in ("32-true", "32", "64-true", "64"):
        raise ConfigError(
            f"parallelism.mixed_precision.param_dtype={explicit.param_dtype} contradicts "
            f"trainer.precision={trainer.precision}: drop the policy (parallelism.mixed_precision="
            f"null follows trainer.precision) or choose trainer.precision=bf16-mixed"
        )
    # components that check their own arguments: built once, here
    built = (
        (instantiate, cfg.schedule.lr),
        (instantiate, cfg.guard),
        (OmegaConf.to_object, grpo(cfg)),
        (OmegaConf.to_object, cfg.phase.get("rollout")),
        (instantiate, cfg.callbacks.get("prometheus")),
        (instantiate, cfg.callbacks.get("watchdog")),
    )
    for build, node in built:
        if node is not None:
            try:
                build(node)
            except Exception as error:
                raise ConfigError(str(error.__cause__ or error).splitlines()[0]) from None
    check_rl(cfg)


def grpo(cfg: DictConfig) -> DictConfig | None:
    """The GRPO settings of an RL phase (phase.grpo), None for other phases."""
    return cfg.phase.get("grpo")


def check_rl(cfg: DictConfig) -> None:
    """RL: the prompts (data=rl), an RL phase and the GRPO module go together, on data-parallel layouts."""
    kinds = {
        "data": issubclass(get_class(cfg.data._target_), PromptDataModule),
        "phase": grpo(cfg) is not None,
        "module": issubclass(get_class(cfg.module._target_), GRPOLitModule),
    }
    if len(set(kinds.values())) > 1:
        raise ConfigError(
            f"data={cfg.data._target_}, phase={cfg.phase.name}, module={cfg.module._target_}: RL needs the prompts "
            f"(data=rl, embedded_rl), an RL phase (phase=rl, toy_rl) and module=grpo together (experiment=rl), "
            f"and other training none of them"
        )
    if not kinds["data"] or cfg.task != "train":
        return
    evaluated = cfg.eval.get("domain_val_fraction", {}).get("rl", cfg.eval.val_fraction)
    if cfg.eval.after_train and evaluated != cfg.data.val_fraction:
        raise ConfigError(
            f"eval.domain_val_fraction.rl={evaluated} differs from data.val_fraction={cfg.data.val_fraction}: the "
            f"evaluation after training would read prompts RL trained on (or leave held-out ones out); set both alike"
        )
    settings = grpo(cfg)
    layout = cfg.parallelism
    split = {k: layout[k] for k in ("tensor_parallel", "pipeline_parallel", "context_parallel") if layout[k] > 1}
    if split or layout.engine == "deepspeed":
        raise ConfigError(
            f"parallelism={layout.name} ({', '.join(f'parallelism.{k}={v}' for k, v in split.items()) or 'ZeRO-3'}): "
            f"RL rolls out with the training model's own generate, over data-parallel ranks whose model is whole "
            f"(single, ddp) or sharded by FSDP2 or expert parallelism (fsdp2, ep, fsdp2_ep); not split within a "
            f"layer or a sequence"
        )
    if cfg.trainer.accumulate_grad_batches != 1:
        raise ConfigError(
            f"trainer.accumulate_grad_batches={cfg.trainer.accumulate_grad_batches}: an RL step is one rollout "
            f"batch and its phase.grpo.updates_per_rollout updates; set it to 1"
        )
    if cfg.data.batch_size % settings.updates_per_rollout:
        raise ConfigError(
            f"phase.grpo.updates_per_rollout={settings.updates_per_rollout} must divide the prompts of a "
            f"step (data.batch_size={cfg.data.batch_size}): each update takes whole prompt groups"
        )
    if cfg.phase.rollout.engine == "vllm":
        check_rollout_engine(cfg)


def check_rollout_engine(cfg: DictConfig) -> None:
    """phase.rollout.engine=vllm: an engine vLLM can start for this model, where this version starts it."""
    rollout = OmegaConf.to_object(cfg.phase.rollout)
    if not rollout.colocate:
        raise ConfigError(
            "phase.rollout.colocate=false: an engine on GPUs of its own (slime's disaggregated mode) is not built; "
            "the engine runs beside the first rank, on the training GPUs (colocate=true)"
        )
    if rollout.tensor_parallel_size > cfg.cluster.devices:
        raise ConfigError(
            f"phase.rollout.tensor_parallel_size={rollout.tensor_parallel_size} > cluster.devices="
            f"{cfg.cluster.devices}: the engine is the first rank's child process, on that rank's node"
        )
    on_this_machine = cfg.cluster.scheduler == "none"
    if rollout.python is not None and on_this_machine and not Path(rollout.python).is_file():
        raise ConfigError(
            f"phase.rollout.python={rollout.python} does not exist: build the serving venv with "
            f"`bash scripts/serving_venv.sh` (it prints its python)"
        )
    cpu = cfg.trainer.accelerator == "cpu" or (on_this_machine and not torch.cuda.is_available())
    device = "cpu" if cpu else "gpu"
    problems = serving_problems(
        model_config(cfg), "vllm", device, rollout.tensor_parallel_size, tp_key="phase.rollout.tensor_parallel_size"
    )
    if problems:
        raise ConfigError("phase.rollout.engine=vllm: " + "; ".join(problems))


def exported_model(key: str, path: str | None, what: str) -> tuple[Path, dict, GLM46Config]:
    """The HF directory at `path` (itself, or a run directory's hf/), its config.json and model config; `key` names
    the setting in errors, `what` the task."""
    if path is None:
        raise ConfigError(f"{key}: no model to {what}; set {key}=<a run directory or an HF directory>")
    try:
        weights = find_weights(path)
        hf_config = json.loads((weights / "config.json").read_text())
        return weights, hf_config, config_from_hf(hf_config)
    except (FileNotFoundError, ValueError, TypeError, KeyError) as error:
        raise ConfigError(f"{key}={path}: {error}") from None


def check_prepare(cfg: DictConfig) -> None:
    """prepare.tasks: at least 1; over several tasks, the staged plan must be possible (glm46.data.staged.work:
    the input exists, holds no fewer files than tasks, and the output directory holds no other preparation)."""
    from glm46.app.preparation import staged_plan

    if cfg.prepare.tasks < 1:
        raise ConfigError(f"prepare.tasks={cfg.prepare.tasks}: the number of tasks of each stage is at least 1")
    if cfg.prepare.tasks > 1:
        staged_plan(cfg.source, cfg.prepare)


def check_serve(cfg: DictConfig) -> GLM46Config:
    """task=serve: an export that the engine, device and launch settings can serve; returns its model config."""
    settings = cfg.serve
    weights, _, config = exported_model("serve.model", settings.model, "serve")
    if settings.tensor_parallel_size < 1 or settings.speculative_steps < 1:
        raise ConfigError(
            f"serve.tensor_parallel_size={settings.tensor_parallel_size} and serve.speculative_steps="
            f"{settings.speculative_steps} must be >= 1"
        )
    problems = serving_problems(
        config, str(settings.engine), str(settings.device), settings.tensor_parallel_size, settings.mtp
    )
    if problems:
        where = f"serve.engine={settings.engine} serve.device={settings.device}: {weights} cannot be served: "
        raise ConfigError(where + "; ".join(problems))
    return config


def check_export(cfg: DictConfig) -> GLM46Config:
    """task=export: an unquantized export to read, a new directory to write, a format built here."""
    settings = cfg.export
    weights, hf_config, config = exported_model("export.model", settings.model, "export")
    if hf_config.get("quantization_config"):
        raise ConfigError(
            f"export.model={settings.model}: {weights} is already quantized ({hf_config['quantization_config']}); "
            f"export the unquantized model"
        )
    if settings.output is None:
        raise ConfigError("export.output: no directory to write; set export.output=<a new directory>")
    output = Path(settings.output)
    if output.exists() and any(output.iterdir()):
        raise ConfigError(f"export.output={output} holds files: an export writes a new directory, never over one")
    if settings.format == "fp8" and settings.block_size < 1:
        raise ConfigError(f"export.block_size={settings.block_size} must be >= 1 (GLM-4.6-FP8: 128)")
    if settings.format == "gguf":
        if not (weights / "tokenizer.json").is_file():
            raise ConfigError(
                f"export.model={settings.model}: {weights} has no tokenizer.json, and a GGUF file carries its "
                f"tokenizer; export a run's model (its hf/ holds the tokenizer it was trained with)"
            )
        if settings.gguf_type == "q4_k_m" and llama_cpp(f"export.gguf_type={settings.gguf_type}") is None:
            raise ConfigError(
                f"export.gguf_type=q4_k_m is made by llama.cpp's quantizer, and no llama.cpp venv is built: run "
                f"bash {LLAMA_CPP_BUILD_SCRIPT} (or set GLM46_LLAMA_CPP_PYTHON), or export gguf_type=f16|q8_0"
            )
    return config


def llama_cpp(key: str) -> Path | None:
    """The llama.cpp venv's python (None: not built); a GLM46_LLAMA_CPP_PYTHON that does not exist is an error."""
    try:
        return llama_cpp_python()
    except FileNotFoundError as error:
        raise ConfigError(f"{key}: {error}") from None


def check_layout(cfg: DictConfig, config: GLM46Config, layout: Layout) -> None:
    """The model and the optimizer against the layout (its own rules ran in Layout.from_config)."""
    problems = model_problems(layout, config)
    optimizer = cfg.optim.get("optimizer")
    if layout.engine == "deepspeed" and optimizer is not None and is_muon(str(optimizer._target_)):
        problems.append(
            f"optim.optimizer={optimizer._target_} with parallelism.engine=deepspeed: ZeRO hands the optimizer flat "
            f"partitions of the parameters, and Muon's Newton-Schulz needs whole matrices; use optim=adamw "
            f"with DeepSpeed, or parallelism=fsdp2 (Muon divides its Newton-Schulz work over the shards there)"
        )
    if problems:
        raise ConfigError(f"parallelism={cfg.parallelism.name}: " + "; ".join(problems))


def check_composed_layout(cfg: DictConfig, config: GLM46Config) -> None:
    layout = composed_layout(cfg)
    check_layout(cfg, config, layout)
    if layout.pipeline_parallel > 1 and cfg.data.get("batch_size", 0) % layout.microbatches:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} must be a multiple of parallelism.microbatches="
            f"{layout.microbatches}: the pipeline splits each rank's batch into that many"
        )
    seq_len = cfg.data.get("seq_len")
    if not isinstance(seq_len, int):
        return
    if layout.sequence_parallel and seq_len % layout.tensor_parallel:
        raise ConfigError(
            f"data.seq_len={seq_len} must be divisible by parallelism.tensor_parallel={layout.tensor_parallel}: "
            f"sequence parallelism gives each TP rank an equal part of every row"
        )
    cp = layout.context_parallel
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(
            f"data.seq_len={seq_len} must be divisible by 2 x parallelism.context_parallel = {2 * cp}: each cp rank "
            f"holds two of 2 x {cp} equal chunks of every row (one early, one late, so causal attention is balanced)"
        )
    if cp > 1 and layout.sequence_parallel and (seq_len // cp) % layout.tensor_parallel:
        raise ConfigError(
            f"data.seq_len={seq_len} / parallelism.context_parallel={cp} = {seq_len // cp} tokens per cp rank must "
            f"be divisible by tensor_parallel={layout.tensor_parallel}: sequence parallelism splits them further"
        )


def check_context_parallel_kernel(cfg: DictConfig, config: GLM46Config) -> None:
    """Context parallelism's attention on GPUs runs CUDA block kernels that a GPU run of bench/gpu_suite.py must have
    verified first (glm46.modules.cuda_kernels); until then planning a GPU cluster with it is allowed, training not."""
    cp, accelerator = cfg.parallelism.get("context_parallel", 1), cfg.cluster.accelerator
    on_gpus = accelerator == "gpu" or (accelerator == "auto" and torch.cuda.is_available())
    if cp > 1 and on_gpus and not cuda_kernels.enabled("context_flash"):
        raise ConfigError(
            f"parallelism.context_parallel={cp} on cluster={cfg.cluster.name} (accelerator={cfg.cluster.accelerator}): "
            f"context parallelism's attention on GPUs needs its CUDA block kernels (cuda_kernels 'context_flash'), "
            f"not yet verified by a GPU run of bench/gpu_suite.py; on GPUs train long rows with sequence parallelism "
            f"(parallelism=long_context), and plan CP with task=plan"
        )


def check_cluster(cfg: DictConfig, config: GLM46Config) -> None:
    check_at_least_one(cfg, ("cluster.num_nodes", "cluster.devices"))
    if cfg.cluster.scheduler == "slurm" and not cfg.cluster.partition:
        raise ConfigError(f"cluster={cfg.cluster.name} submits to Slurm but cluster.partition is not set")
    for key in ("max_restarts", "restarts_without_progress"):
        if cfg.cluster[key] < 0:
            raise ConfigError(f"cluster.{key}={cfg.cluster[key]} must be >= 0 (0: a failed job waits for a person)")


def check_engine(cfg: DictConfig, config: GLM46Config) -> None:
    """The engine the layout runs on: its collectives' timeout, and DeepSpeed when it is chosen."""
    if not cfg.parallelism.timeout_s > 0:
        raise ConfigError(
            f"parallelism.timeout_s={cfg.parallelism.timeout_s!r} must be a number of seconds > 0 (how long a rank "
            f"waits for the others in a collective)"
        )
    if cfg.parallelism.async_checkpoint and not (
        cfg.parallelism.engine == "mesh" and cfg.parallelism.strategy.get("save_distributed_checkpoint", False)
    ):
        raise ConfigError(
            f"parallelism.async_checkpoint=true with parallelism={cfg.parallelism.name}: background saves write DCP "
            f"folders, which the mesh layouts save (fsdp2, ep, tp, fsdp2_ep, production, ...)"
        )
    if cfg.parallelism.engine == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            f"parallelism={cfg.parallelism.name} needs DeepSpeed, which is not installed: "
            f"pip install 'glm46[deepspeed]' (make install does)"
        )


def check_values(cfg: DictConfig, config: GLM46Config) -> None:
    check_at_least_one(cfg)
    check_choices(cfg)


def check_memory(cfg: DictConfig, config: GLM46Config) -> None:
    """On GPUs: the plan's memory per GPU fits the cluster's (glm46.planning.plan)."""
    if cfg.cluster.accelerator == "gpu":
        result = composed_plan(cfg, config)[0]
        if not result["fits"]:
            raise ConfigError(f"cluster={cfg.cluster.name}, parallelism={cfg.parallelism.name}: " + result["notes"][-1])


# What `validate` checks after the model and the missing values, in order: (the groups a check relates, the tasks it
# applies to, the check). Each component checks its own arguments beside its class (built once in check_training);
# these are the relations between groups.
ALL, TRAIN = ("train", "estimate", "plan", "dryrun", "eval"), ("train",)
CHECKS = (
    ("data x model x phase", ALL, check_data),
    ("cluster", ALL, check_cluster),
    ("parallelism x model x optimizer x cluster x data", ALL, check_composed_layout),
    ("parallelism x installed engines", ALL, check_engine),
    ("phase budget x trainer", TRAIN, lambda cfg, config: check_budget(cfg)),
    ("sizes and names", ALL, check_values),
    ("recipe x schedule x phase", ALL, lambda cfg, config: check_recipe(cfg)),
    ("every interpolation training reads", TRAIN, lambda cfg, config: resolve(cfg, RESOLVED_BEFORE_TRAINING)),
    ("optimizer x precision, components, RL", TRAIN, lambda cfg, config: check_training(cfg)),
    ("memory per GPU x cluster", TRAIN, check_memory),
    ("context parallelism x accelerator", TRAIN, check_context_parallel_kernel),
)


def validate(cfg: DictConfig) -> GLM46Config:
    """Reject a composition that cannot run, before any work starts; return its model config (task=serve: the
    export's)."""
    if cfg.task == "serve":  # reads the export and serve.*, not the composition's model or data
        return check_serve(cfg)
    if cfg.task == "export":  # likewise: the export and export.*
        return check_export(cfg)
    refuse_missing(cfg)
    config = model_config(cfg)
    if cfg.task == "prepare":  # reads its source and the prepare settings only; the pipeline checks them
        if cfg.get("source") is None:
            raise ConfigError("task=prepare reads `source`, and none is chosen: source=embedded|jsonl|text|parquet")
        check_prepare(cfg)
        return config
    for _, tasks, check in CHECKS:
        if str(cfg.task) in tasks:
            check(cfg, config)
    return config
