"""Schemas of the groups that build the training loop: trainer, optim, schedule, recipe, guard, callbacks, logger.

Each `_target_` node lists the constructor arguments the configs set; Hydra refuses any other key while
composing, naming it (`schedule.val_check_interval`). Values of `${...}` interpolations are checked when
resolved, before anything runs (glm46.app.checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import II, MISSING


@dataclass
class TrainerConfig:
    """The Lightning Trainer arguments glm46 sets (lightning.pytorch.Trainer)."""

    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = MISSING
    devices: int = MISSING
    num_nodes: int = MISSING
    strategy: Any = MISSING
    precision: str = MISSING  # Lightning's names: 32-true, bf16-mixed, bf16-true, ...
    max_steps: int = MISSING
    max_epochs: int = MISSING
    accumulate_grad_batches: int = MISSING
    gradient_clip_val: Optional[float] = None
    val_check_interval: Any = MISSING  # steps (int) or a fraction of an epoch (float): Lightning reads the type
    limit_val_batches: Any = MISSING
    log_every_n_steps: int = MISSING
    num_sanity_val_steps: int = MISSING
    deterministic: Any = MISSING  # true | false | "warn"


@dataclass
class MuonArgs:
    """glm46.optim.Muon: Muon for matrices, AdamW (betas, eps) for the groups with use_muon=False."""

    _target_: str = "glm46.optim.Muon"
    _partial_: bool = True  # the LightningModule passes the parameter groups
    lr: float = MISSING
    weight_decay: float = MISSING
    momentum: float = MISSING
    nesterov: bool = MISSING
    ns_steps: int = MISSING
    ns_dtype: str = MISSING
    update_rms: float = MISSING
    betas: List[float] = MISSING
    eps: float = MISSING


@dataclass
class AdamWArgs:
    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = MISSING
    weight_decay: float = MISSING
    betas: List[float] = MISSING
    eps: float = MISSING


@dataclass
class MuonOptim:
    optimizer: MuonArgs = field(default_factory=MuonArgs)
    min_lr: float = MISSING  # the floor of the LR schedule


@dataclass
class AdamWOptim:
    optimizer: AdamWArgs = field(default_factory=AdamWArgs)
    min_lr: float = MISSING


@dataclass
class WarmupCosine:
    _target_: str = "glm46.optim.WarmupCosine"
    peak: float = MISSING
    floor: float = MISSING
    warmup_tokens: int = MISSING
    total_tokens: int = MISSING


@dataclass
class WarmupStableDecay(WarmupCosine):
    _target_: str = "glm46.optim.WarmupStableDecay"
    decay_tokens: int = MISSING


@dataclass
class Piecewise:
    """A value that steps at token boundaries (glm46.optim.Piecewise)."""

    _target_: str = "glm46.optim.Piecewise"
    values: List[float] = MISSING
    boundaries: List[int] = MISSING


@dataclass
class LinearRamp:
    _target_: str = "glm46.optim.LinearRamp"
    start: float = MISSING
    end: float = MISSING
    ramp_tokens: int = MISSING


@dataclass
class RecipeConfig:
    """The token clock that pre-training and mid-training share (conf/recipe/*.yaml): the phases in order with their
    tokens, and the recipe's tokens at which the warm-ups end and the switches fall."""

    phases: Dict[str, int] = MISSING  # phase name -> tokens, in training order
    tokens: int = II("recipe_length:${.phases}")  # the clock's length: where the LR reaches its floor
    warmup_tokens: int = MISSING
    switch_tokens: int = MISSING  # MTP weight and balancer rate
    batch_warmup_tokens: int = MISSING  # the global batch's ramp (callbacks=batch_warmup)


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
    mtp_weight: Piecewise = field(default_factory=Piecewise)
    balancer_rate: Piecewise = field(default_factory=Piecewise)


@dataclass
class GuardConfig:
    """glm46.lit.guard.StepGuard (conf/guard/default.yaml explains each key)."""

    _target_: str = "glm46.lit.guard.StepGuard"
    spike_factor: float = MISSING
    warmup_steps: int = MISSING
    ema_decay: float = MISSING
    max_bad_steps: int = MISSING
    on_repeated: str = MISSING
    max_rollbacks: int = MISSING


@dataclass
class ModelCheckpointCallback:
    _target_: str = "glm46.lit.callbacks.ModelCheckpoint"
    dirpath: str = MISSING
    filename: str = MISSING
    auto_insert_metric_name: bool = MISSING
    every_n_train_steps: int = MISSING
    save_top_k: int = MISSING
    monitor: Optional[str] = None
    mode: str = MISSING
    save_last: bool = MISSING
    enable_version_counter: bool = MISSING


@dataclass
class ExpertBalancerCallback:
    _target_: str = "glm46.lit.callbacks.ExpertBalancer"
    rate: Any = MISSING
    rule: str = MISSING


@dataclass
class ThroughputCallback:
    _target_: str = "glm46.lit.callbacks.Throughput"
    peak_flops: Optional[float] = None
    window_size: int = 10  # optimizer steps averaged, as Lightning's ThroughputMonitor


@dataclass
class ProgressBarCallback:
    _target_: str = "lightning.pytorch.callbacks.TQDMProgressBar"
    refresh_rate: int = MISSING


@dataclass
class PreemptionCallback:
    _target_: str = "glm46.lit.callbacks.Preemption"
    signals: List[str] = MISSING
    requeue: bool = MISSING


@dataclass
class BatchSizeWarmupCallback:
    _target_: str = "glm46.lit.callbacks.BatchSizeWarmup"
    tokens_per_step: LinearRamp = field(default_factory=LinearRamp)


@dataclass
class CSVLoggerConfig:
    _target_: str = "glm46.lit.csv_logger.AppendingCSVLogger"
    save_dir: str = MISSING
    name: str = MISSING
    version: str = MISSING


@dataclass
class TensorBoardLoggerConfig:
    _target_: str = "lightning.pytorch.loggers.TensorBoardLogger"
    save_dir: str = MISSING
    name: str = MISSING
    version: str = MISSING


@dataclass
class WandbLoggerConfig:
    _target_: str = "lightning.pytorch.loggers.WandbLogger"
    save_dir: str = MISSING
    project: str = MISSING
    name: str = MISSING
    offline: bool = MISSING


CALLBACKS = {
    "model_checkpoint": ModelCheckpointCallback,
    "expert_balancer": ExpertBalancerCallback,
    "throughput": ThroughputCallback,
    "progress_bar": ProgressBarCallback,
    "preemption": PreemptionCallback,
    "batch_size_warmup": BatchSizeWarmupCallback,
}
LOGGERS = {"csv": CSVLoggerConfig, "tensorboard": TensorBoardLoggerConfig, "wandb": WandbLoggerConfig}
