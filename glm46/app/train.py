"""The `train` task: build the DataModule, LightningModule, callbacks, loggers and Trainer from the
composed config, fit, then export the final weights to HF format and draw the plots."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.plugins.environments import SLURMEnvironment
from omegaconf import DictConfig, OmegaConf

from glm46.app.logs import rank_zero_logger
from glm46.app.plots import plot_run
from glm46.checkpoint import save_hf
from glm46.checkpoint.atomic import AtomicCheckpointIO, resume_path
from glm46.checkpoint.reshard import LayoutRecord, check_resume
from glm46.data.tokenizer import GLMTokenizer
from glm46.errors import ConfigError
from glm46.eval import evaluate
from glm46.lit import GLM46LitModule
from glm46.lit.callbacks import Preemption
from glm46.modules import GLM46Config
from glm46.parallel import build_strategy
from glm46.planning.sizing import composed_layout
from glm46.rl.grpo_module import GRPOLitModule

log = rank_zero_logger(__name__)


def is_rl(cfg: DictConfig) -> bool:
    """An RL phase (conf/phase/rl.yaml): GRPOLitModule trains it."""
    return "samples_per_prompt" in cfg.phase


def build_module(cfg: DictConfig, config: GLM46Config) -> GLM46LitModule:
    """Under the mesh layouts (FSDP2, HSDP, TP, EP) the model is built on the meta device and each rank
    materialises only its shards (GLM46LitModule.configure_model); one process, DDP and DeepSpeed build it whole.
    An RL phase gets GRPOLitModule with the phase's GRPO settings."""
    common = dict(
        optimizer=instantiate(cfg.optim.optimizer),
        lr_schedule=instantiate(cfg.schedule.lr),
        mtp_weight=instantiate(cfg.schedule.mtp_weight),
        init_from=str(cfg.init_from) if cfg.init_from else None,
        recipe_start=cfg.schedule.start_tokens,
    )
    if is_rl(cfg):
        phase = cfg.phase
        return GRPOLitModule(
            config,
            **common,
            tokenizer_path=str(Path(cfg.data.path) / "tokenizer.json"),
            samples_per_prompt=phase.samples_per_prompt,
            max_new_tokens=phase.max_new_tokens,
            temperature=phase.temperature,
            eps_clip=phase.eps_clip,
            eps_clip_high=phase.eps_clip_high,
            scale_rewards=phase.scale_rewards,
            loss_aggregation=phase.loss_aggregation,
            kl_coef=phase.kl_coef,
            updates_per_rollout=phase.updates_per_rollout,
            gradient_clip_val=cfg.trainer.gradient_clip_val,
            seed=cfg.seed,
        )
    return GLM46LitModule(
        config,
        **common,
        balance_loss_alpha=cfg.schedule.balance_loss_alpha,
        # DeepSpeed's engine steps its own (partitioned) optimizer and skips overflowing steps itself.
        guard=instantiate(cfg.guard) if cfg.get("guard") and cfg.parallelism.engine != "deepspeed" else None,
        empty_init=cfg.parallelism.engine == "mesh",
    )


def build_trainer(cfg: DictConfig, output_dir: Path) -> L.Trainer:
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c is not None]
    callbacks.append(LayoutRecord(cfg.parallelism.name, cfg.global_batch_tokens))  # what a resume checks against
    loggers = [instantiate(c) for c in cfg.logger.values() if c is not None]
    plugins = []
    if SLURMEnvironment.detect():  # the Preemption callback owns checkpoint-and-requeue, not Lightning
        plugins.append(SLURMEnvironment(auto_requeue=False))
    if cfg.parallelism.engine != "deepspeed":  # DeepSpeed writes its own folders (with a `latest` marker)
        plugins.append(AtomicCheckpointIO())
    # GRPOLitModule optimizes manually (rollouts and updates alternate) and clips gradients itself.
    clip = {"gradient_clip_val": None} if is_rl(cfg) else {}
    return instantiate(
        cfg.trainer,
        strategy=build_strategy(cfg.parallelism, composed_layout(cfg)),
        callbacks=callbacks,
        logger=loggers,
        plugins=plugins,
        default_root_dir=str(output_dir),
        **clip,
    )


def train(cfg: DictConfig, config: GLM46Config) -> dict[str, float]:
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    if datamodule.vocab_size > config.vocab_size:
        raise ConfigError(
            f"data: the tokenizer has {datamodule.vocab_size} tokens but model.vocab_size={config.vocab_size}"
        )
    module = build_module(cfg, config)
    trainer = build_trainer(cfg, output_dir)
    checkpoint_dir = Path(getattr(trainer.checkpoint_callback, "dirpath", None) or output_dir / "checkpoints")
    ckpt_path = resume_path(cfg.ckpt_path, checkpoint_dir)
    if ckpt_path:  # another layout or world size may continue it; what none can is refused here, before training
        check_resume(ckpt_path, cfg)
    hyperparameters = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # the composition, as run
    for logger in trainer.loggers:  # wandb's config, TensorBoard's hparams, hparams.yaml beside metrics.csv
        logger.log_hyperparams(hyperparameters)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    interrupted = [c.interrupted_at for c in trainer.callbacks if isinstance(c, Preemption) and c.interrupted_at]
    if interrupted:
        log.info(f"interrupted at step {interrupted[0]}: resume with hydra.run.dir={output_dir} ckpt_path=last")
        return {}
    # Every rank: gathers FSDP2/TP/EP/ZeRO-3 shards; rank 0 writes, with the dataset's tokenizer beside the weights.
    tokenizer_file = getattr(datamodule, "tokenizer_file", None)  # None: the byte-level stdlib DataModule
    tokenizer = GLMTokenizer.from_file(tokenizer_file) if tokenizer_file else None
    save_hf(module.model, output_dir / "hf", tokenizer=tokenizer)
    if trainer.is_global_zero:
        if cfg.eval.after_train:
            evaluate(cfg.eval, output_dir / "hf", output_dir, trainer.loggers, step=trainer.global_step)
        for path in plot_run(output_dir):
            log.info(f"wrote {path}")
        log.info(f"run directory: {output_dir} (checkpoints/, hf/, metrics.csv, loss.png, expert_load.png)")
    return {k: float(v) for k, v in trainer.callback_metrics.items()}
