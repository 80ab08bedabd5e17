"""What a training run relates beyond the layout: its phase budget, the recipe's clock, the optimizer against the
precision, each component's own arguments, RL's rollouts, and the checkpoints it starts from."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from glm46.checkpoint.engine_limits import serving_problems
from glm46.checkpoint.safe_load import UnsafeCheckpointError, check_safe
from glm46.config.resolvers import phase_steps, recipe_start
from glm46.errors import ConfigError
from glm46.lit.preference_data import PreferenceDataModule
from glm46.logs import rank_zero_logger
from glm46.rl.dpo_module import DPOLitModule
from glm46.rl.grpo_module import GRPOLitModule
from glm46.rl.ppo_module import PPOLitModule
from glm46.rl.prompts import PromptDataModule
from glm46.rl.reward_model import RewardModelLitModule
from glm46.rl.rlhf import check_reward_model

from .values import model_config, resolve, value_at

log = rank_zero_logger(__name__)


def check_budget(cfg: DictConfig) -> None:
    """A step count derived from the phase's token budget (toy_stage, pretrain_phase1) spends at least one step."""
    trainer, phase, global_batch = cfg.trainer, cfg.phase, value_at(cfg, "global_batch_tokens")
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
        (OmegaConf.to_object, cfg.phase.get("ppo")),
        (OmegaConf.to_object, cfg.phase.get("rollout")),
        (OmegaConf.to_object, cfg.phase.get("reward")),
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
    check_preference(cfg)


def check_checkpoints(cfg: DictConfig) -> None:
    """`init_from` and an explicit `ckpt_path`: a pickle in them that asks for more than glm46's checkpoints hold is
    refused here, before anything is queued or read (glm46.checkpoint.safe_load). Paths that do not exist yet (a
    curriculum's later stages) are checked when they are read."""
    for key in ("init_from", "ckpt_path"):
        value = cfg.get(key)
        if value and value != "last" and Path(value).exists():
            try:
                check_safe(value)
            except UnsafeCheckpointError as error:
                raise UnsafeCheckpointError(f"{key}={value}: {error}") from None


def grpo(cfg: DictConfig) -> DictConfig | None:
    """The GRPO settings of an RL phase (phase.grpo), None for other phases."""
    return cfg.phase.get("grpo")


def ppo(cfg: DictConfig) -> bool:
    """Whether the module is PPO's (phase.ppo is read)."""
    return issubclass(get_class(cfg.module._target_), PPOLitModule)


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
    shares = cfg.eval.get("domain_val_fraction") or {}
    evaluated = shares.get("rl", cfg.eval.val_fraction)
    if cfg.eval.after_train and evaluated != cfg.data.val_fraction:
        raise ConfigError(
            f"eval.domain_val_fraction.rl={evaluated} differs from data.val_fraction={cfg.data.val_fraction}: the "
            f"evaluation after training would read prompts RL trained on (or leave held-out ones out); set both alike"
        )
    for domain, weight in (cfg.data.mixture or {}).items():  # the other domains RL trains on: within its held-out
        evaluated = shares.get(domain, cfg.eval.val_fraction)
        if cfg.eval.after_train and weight and evaluated > cfg.data.val_fraction:
            raise ConfigError(
                f"eval.domain_val_fraction.{domain}={evaluated} is more than data.val_fraction={cfg.data.val_fraction}"
                f": the evaluation after training would read {domain} prompts RL trained on"
            )
    settings = grpo(cfg)
    if ppo(cfg) and settings.kl_coef > 0:
        raise ConfigError(
            f"phase.grpo.kl_coef={settings.kl_coef} with module=ppo: PPO's KL is its penalty in the token rewards "
            f"(phase.ppo.kl_coef, adaptive with phase.ppo.kl_target); GRPO's loss term would add a second one. Set "
            f"phase.grpo.kl_coef=0"
        )
    kl = {"phase.grpo.kl_coef": settings.kl_coef, "phase.ppo.kl_coef": cfg.phase.ppo.kl_coef if ppo(cfg) else 0}
    for key, value in kl.items():
        if value > 0 and not cfg.get("init_from"):
            raise ConfigError(f"{key}={value}: the KL is against the starting policy, and no init_from names it")
    check_reward_model(OmegaConf.to_object(cfg.phase.reward), Path(cfg.data.path) / "tokenizer.json", "data.path")
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
    if settings.dynamic_temperature.enabled and not cfg.data.val_fraction:
        raise ConfigError(
            "phase.grpo.dynamic_temperature.enabled=true with data.val_fraction=0: the temperature is chosen on "
            "held-out prompts; hold some out"
        )
    if settings.dynamic_sampling and ppo(cfg):
        raise ConfigError(
            "phase.grpo.dynamic_sampling=true with module=ppo: PPO's advantages come from its critic's values, not "
            "from prompt groups, so no group is flat; dynamic sampling is GRPO's (module=grpo)"
        )
    if cfg.phase.rollout.engine == "vllm":
        check_rollout_engine(cfg)


PREFERENCE_MODULES = (RewardModelLitModule, DPOLitModule)


def check_preference(cfg: DictConfig) -> None:
    """Preference pairs (data=preference) and the modules that learn from them go together, on layouts that keep
    each sequence whole on a rank whose model ends with the final norm (the score and the log-probs read it)."""
    data = issubclass(get_class(cfg.data._target_), PreferenceDataModule)
    module = issubclass(get_class(cfg.module._target_), PREFERENCE_MODULES)
    if data != module:
        raise ConfigError(
            f"data={cfg.data._target_}, module={cfg.module._target_}: preference pairs (data=preference) are "
            f"trained by module=reward_model or module=dpo, and those modules train on nothing else"
        )
    layout = cfg.parallelism
    split = {k: layout[k] for k in ("tensor_parallel", "pipeline_parallel", "context_parallel") if layout[k] > 1}
    if module and (split or layout.engine == "deepspeed"):
        raise ConfigError(
            f"parallelism={layout.name} ({', '.join(f'parallelism.{k}={v}' for k, v in split.items()) or 'ZeRO-3'}): "
            f"{cfg.module._target_} trains on data-parallel layouts whose ranks hold whole sequences and the final "
            f"norm (single, ddp, fsdp2, ep, fsdp2_ep)"
        )


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
