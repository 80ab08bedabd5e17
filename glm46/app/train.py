"""The `train` task: build the DataModule, LightningModule, callbacks, loggers and Trainer from the
composed config, fit, then export the final weights to HF format and draw the plots."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.plugins.environments import SLURMEnvironment
from omegaconf import DictConfig, OmegaConf

from glm46.checkpoint.atomic import AtomicCheckpointIO, resume_path
from glm46.checkpoint.reshard import LayoutRecord, check_resume
from glm46.data.tokenizer import GLMTokenizer
from glm46.errors import ConfigError
from glm46.eval import evaluate
from glm46.lit import GLM46LitModule
from glm46.lit.callbacks import Preemption
from glm46.lit.strategies import build_strategy
from glm46.logs import rank_zero_logger
from glm46.modules import GLM46Config
from glm46.planning.sizing import composed_layout
from glm46.reports.plots import plot_run
from glm46.rl.reward_model import RewardModelLitModule
from glm46.rl.score import held_out_scoring, score

log = rank_zero_logger(__name__)


def build_module(cfg: DictConfig, config: GLM46Config) -> GLM46LitModule:
    """The `module` node (conf/module: causal_lm, or grpo for RL), given the validated model config. Under the mesh
    layouts the model is built on the meta device and each rank materialises only its shards
    (GLM46LitModule.configure_model); one process, DDP and DeepSpeed build it whole."""
    return instantiate(cfg.module, model_config=config, _convert_="object")


def build_trainer(cfg: DictConfig, output_dir: Path, module: L.LightningModule) -> L.Trainer:
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c is not None]
    callbacks.append(LayoutRecord(cfg.parallelism.name, cfg.global_batch_tokens))  # what a resume checks against
    loggers = [instantiate(c) for c in cfg.logger.values() if c is not None]
    plugins = []
    if SLURMEnvironment.detect():  # the Preemption callback owns checkpoint-and-requeue, not Lightning
        plugins.append(SLURMEnvironment(auto_requeue=False))
    if cfg.parallelism.engine != "deepspeed":  # DeepSpeed writes its own folders (with a `latest` marker)
        plugins.append(AtomicCheckpointIO())
    # A module that optimizes by hand (GRPO: rollouts and updates alternate) clips gradients itself.
    clip = {} if module.automatic_optimization else {"gradient_clip_val": None}
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
    trainer = build_trainer(cfg, output_dir, module)
    checkpoint_dir = Path(getattr(trainer.checkpoint_callback, "dirpath", None) or output_dir / "checkpoints")
    ckpt_path = resume_path(cfg.ckpt_path, checkpoint_dir)
    if ckpt_path:  # another layout or world size may continue it; what none can is refused here, before training
        check_resume(ckpt_path, cfg)
    hyperparameters = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # the composition, as run
    for logger in trainer.loggers:  # wandb's config, TensorBoard's hparams, hparams.yaml beside metrics.csv
        logger.log_hyperparams(hyperparameters)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)  # glm46.checkpoint.safe_load
    interrupted = [c.interrupted_at for c in trainer.callbacks if isinstance(c, Preemption) and c.interrupted_at]
    if interrupted:
        log.info(f"interrupted at step {interrupted[0]}: resume with hydra.run.dir={output_dir} ckpt_path=last")
        return {"interrupted_at": interrupted[0]}
    # Every rank: gathers FSDP2/TP/EP/ZeRO-3 shards; rank 0 writes, with the dataset's tokenizer beside the weights.
    tokenizer_file = getattr(datamodule, "tokenizer_file", None)  # None: the byte-level stdlib DataModule
    tokenizer = GLMTokenizer.from_file(tokenizer_file) if tokenizer_file else None
    module.export(output_dir / "hf", tokenizer)
    if trainer.is_global_zero:
        if cfg.eval.after_train and isinstance(module, RewardModelLitModule):  # scores pairs, writes no text
            score(held_out_scoring(cfg, output_dir / "hf"), output_dir)
        elif cfg.eval.after_train:
            evaluate(cfg.eval, output_dir / "hf", output_dir, trainer.loggers, step=trainer.global_step)
        for path in plot_run(output_dir):
            log.info(f"wrote {path}")
        log.info(f"run directory: {output_dir} (checkpoints/, hf/, metrics.csv, loss.png, expert_load.png)")
    return {k: float(v) for k, v in trainer.callback_metrics.items()}
