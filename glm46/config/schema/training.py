"""Schemas of the groups that build the training loop: trainer, optim, schedule, recipe, guard, callbacks, logger.

A `_target_` node's schema is derived from its constructor (glm46.config.schema.derive), so Hydra refuses any key the
constructor does not take while composing, naming it; only the nodes without a target (optim, schedule, recipe)
are written here. Values of `${...}` interpolations are checked when resolved, before anything runs
(glm46.config.checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import torch
from omegaconf import II, MISSING

from glm46.lit import GLM46LitModule
from glm46.lit.callbacks import (
    BatchSizeWarmup,
    ExpertBalancer,
    HangWatchdog,
    ModelCheckpoint,
    Preemption,
    Progress,
    PrometheusExporter,
    RankPlacement,
    Throughput,
)
from glm46.lit.csv_logger import AppendingCSVLogger
from glm46.lit.guard import StepGuard
from glm46.optim import LinearRamp, Muon, Piecewise, WarmupCosine, WarmupStableDecay
from glm46.peft import AdapterSettings
from glm46.rl.dpo_module import DPOLitModule
from glm46.rl.grpo_module import GRPOLitModule
from glm46.rl.ppo_module import PPOLitModule
from glm46.rl.reward_model import RewardModelLitModule

from .derive import target_schema

TrainerConfig = target_schema(pl.Trainer, path="lightning.pytorch.Trainer", name="TrainerConfig")
MuonArgs = target_schema(Muon, path="glm46.optim.Muon", partial=True, exclude=["params"])
# torch's implementation switches (foreach, fused, ...) are left to torch: `+optim.optimizer.fused=true` adds one
AdamWArgs = target_schema(
    torch.optim.AdamW,
    path="torch.optim.AdamW",
    partial=True,
    exclude=[
        "params",
        "amsgrad",
        "maximize",
        "foreach",
        "capturable",
        "differentiable",
        "fused",
        "decoupled_weight_decay",
    ],
)


@dataclass
class MuonOptim:
    lr: float = MISSING  # the peak LR (`optim.lr`), which optimizer.lr refers to
    ns_batch_bytes: int = MISSING  # Newton-Schulz's batch (`optim.ns_batch_bytes`), which the optimizer's refers to
    optimizer: MuonArgs = field(default_factory=MuonArgs)


@dataclass
class AdamWOptim:
    lr: float = MISSING
    optimizer: AdamWArgs = field(default_factory=AdamWArgs)


WarmupCosineSchema = target_schema(WarmupCosine, path="glm46.optim.WarmupCosine")
WarmupStableDecaySchema = target_schema(
    WarmupStableDecay, path="glm46.optim.WarmupStableDecay", base=WarmupCosineSchema
)
PiecewiseSchema = target_schema(Piecewise, path="glm46.optim.Piecewise")
LinearRampSchema = target_schema(LinearRamp, path="glm46.optim.LinearRamp")


@dataclass
class RecipeConfig:
    """The token clock that pre-training and mid-training share (conf/recipe/*.yaml): the phases in order with their
    tokens, and the recipe's tokens at which the warm-ups end and the switches fall."""

    phases: Dict[str, int] = MISSING  # phase name -> tokens, in training order
    tokens: int = II("recipe_length:${.phases}")  # the clock's length: where the LR reaches its floor
    warmup_tokens: int = MISSING
    switch_tokens: int = MISSING  # MTP weight and balancer rate
    batch_warmup_tokens: int = MISSING  # the global batch's ramp (callbacks=batch_warmup)
    post_training: List[str] = field(default_factory=list)  # phases after the clock, which start past the switch


@dataclass
class ScheduleConfig:
    """Everything that moves with the recipe's tokens: LR, MTP loss weight, balancer rate, batch-size warm-up; and
    where this run sits on the recipe's clock (conf/schedule/glm45.yaml explains the keys)."""

    run_tokens: int = MISSING
    start_tokens: int = MISSING
    scale: float = MISSING
    end_tokens: int = MISSING
    switch_tokens: int = MISSING
    batch_warmup_tokens: int = MISSING
    decay_fraction: Optional[float] = None  # the WSD schedule's decay share of the clock
    balance_loss_alpha: float = MISSING
    lr: Any = MISSING  # WarmupCosine or WarmupStableDecay (their schemas: schedule/schema/*)
    mtp_weight: PiecewiseSchema = field(default_factory=PiecewiseSchema)
    balancer_rate: PiecewiseSchema = field(default_factory=PiecewiseSchema)


CausalLMModule = target_schema(GLM46LitModule, path="glm46.lit.GLM46LitModule", exclude=["model_config"])
GRPOModule = target_schema(  # the reward function is passed in code; `grpo` is typed where it is set (phase.grpo)
    GRPOLitModule, path="glm46.rl.grpo_module.GRPOLitModule", exclude=["reward"], base=CausalLMModule, name="GRPOModule"
)
PPOModule = target_schema(  # `ppo` is typed where it is set (phase.ppo)
    PPOLitModule, path="glm46.rl.ppo_module.PPOLitModule", exclude=["reward"], base=GRPOModule, name="PPOModule"
)
RewardModelModule = target_schema(
    RewardModelLitModule,
    path="glm46.rl.reward_model.RewardModelLitModule",
    base=CausalLMModule,
    name="RewardModelModule",
)
DPOModule = target_schema(DPOLitModule, path="glm46.rl.dpo_module.DPOLitModule", base=CausalLMModule, name="DPOModule")
GuardConfig = target_schema(StepGuard, path="glm46.lit.guard.StepGuard", name="GuardConfig")
PeftConfig = target_schema(AdapterSettings, path="glm46.peft.AdapterSettings", name="PeftConfig")
CALLBACKS = {
    "model_checkpoint": target_schema(
        ModelCheckpoint, path="glm46.lit.callbacks.ModelCheckpoint", name="ModelCheckpointCallback"
    ),
    "expert_balancer": target_schema(ExpertBalancer, path="glm46.lit.callbacks.ExpertBalancer"),
    "throughput": target_schema(Throughput, path="glm46.lit.callbacks.Throughput"),
    "progress_bar": target_schema(Progress, path="glm46.lit.callbacks.Progress"),
    "preemption": target_schema(Preemption, path="glm46.lit.callbacks.Preemption"),
    "prometheus": target_schema(PrometheusExporter, path="glm46.lit.callbacks.PrometheusExporter"),
    "watchdog": target_schema(HangWatchdog, path="glm46.lit.callbacks.HangWatchdog"),
    "placement": target_schema(RankPlacement, path="glm46.lit.callbacks.RankPlacement"),
    "batch_size_warmup": target_schema(
        BatchSizeWarmup, path="glm46.lit.callbacks.BatchSizeWarmup", nested={"tokens_per_step": LinearRampSchema}
    ),
}
LOGGERS = {
    "csv": target_schema(AppendingCSVLogger, path="glm46.lit.csv_logger.AppendingCSVLogger"),
    "tensorboard": target_schema(pl.loggers.TensorBoardLogger, path="lightning.pytorch.loggers.TensorBoardLogger"),
    "wandb": target_schema(pl.loggers.WandbLogger, path="lightning.pytorch.loggers.WandbLogger"),
}
