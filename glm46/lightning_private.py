"""Every use of a Lightning private member in glm46, each kept because Lightning has no public hook for it.

Checked against Lightning 2.6.6 (pyproject allows >=2.6,<2.7). tests/test_lightning_private.py asserts that each
member used here still exists with the signature and behaviour relied on, so an upgrade that changes one fails
there, by name, instead of deep inside a run. It imports only Lightning, so that glm46.parallel and glm46.lit
(which imports glm46.parallel) both can use it.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy


def init_model_parallel_processes(strategy: ModelParallelStrategy) -> None:
    """ModelParallelStrategy's `_setup_distributed` (root device, seed reset, world ranks, process group with the
    strategy's backend and timeout). Its public `setup_environment` runs it and then builds Lightning's 2-D
    (data, tensor) mesh, which cannot express the 5-D layouts and fails when data x tensor != world size."""
    strategy._setup_distributed()


def attach_device_mesh(strategy: ModelParallelStrategy, mesh: torch.distributed.DeviceMesh) -> None:
    """Set what `strategy.device_mesh` and `strategy.lightning_module.device_mesh` return: both are read-only
    properties over `_device_mesh`, which Lightning's own `setup_environment` assigns the same way."""
    strategy._device_mesh = mesh
    strategy.lightning_module._device_mesh = mesh


def init_deepspeed_processes(strategy: DeepSpeedStrategy) -> None:
    """DeepSpeedStrategy's `_init_deepspeed_distributed` (MASTER_ADDR/RANK/... variables, then
    `deepspeed.init_distributed` with the strategy's backend, port and timeout): its public `setup_distributed`
    without the check that device indices equal local ranks, which CPU devices (index None) fail."""
    strategy._init_deepspeed_distributed()


class DeepSpeedInitializeHook:
    """Mixin listed before DeepSpeedStrategy: Lightning's `_setup_model_and_optimizer`, the one method that calls
    `deepspeed.initialize` for training, goes to the subclass's `deepspeed_initialize(model, optimizer,
    lr_scheduler) -> (engine, optimizer)`; `lightning_deepspeed_initialize` is Lightning's own. No public hook runs
    between the optimizer's creation and `deepspeed.initialize` or sees its arguments (`device_rank` is the CUDA
    index: None on CPU)."""

    def _setup_model_and_optimizer(self, model: torch.nn.Module, optimizer: Any, lr_scheduler: Any = None):
        return self.deepspeed_initialize(model, optimizer, lr_scheduler)

    def lightning_deepspeed_initialize(self, model: torch.nn.Module, optimizer: Any, lr_scheduler: Any = None):
        return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)


def ends_optimizer_step(trainer: L.Trainer) -> bool:
    """Whether the training batch in progress is the last of its optimizer step: Lightning's own decision
    (`_should_accumulate`: the accumulation's last batch, or the epoch's), which no public attribute states."""
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def last_saved_step(callback: ModelCheckpoint) -> int:
    """The global step of `callback`'s own latest save (`_last_global_step_saved`; 0 before any). Public hooks
    (`on_save_checkpoint`) report every save, not this callback's, and only its own saves refresh last.ckpt."""
    return callback._last_global_step_saved


def save_last_checkpoint(callback: ModelCheckpoint, trainer: L.Trainer) -> None:
    """Write `callback`'s last.ckpt now, exactly as its periodic saves do (`_save_last_checkpoint` with
    `_monitor_candidates`: name formatting, version counter, `save_last="link"`, `last_model_path`, removal of the
    previous one, loggers' `after_save_checkpoint`). ModelCheckpoint has no public method that saves."""
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


class AppendingExperimentWriter(ExperimentWriter):
    """CSVLogger's writer, keeping an existing metrics.csv and its columns. The stock writer deletes the file in
    `_check_log_dir_exists`, called from its constructor, with no option to keep it."""

    def _check_log_dir_exists(self) -> None:
        fs = get_filesystem(self.metrics_file_path)
        if fs.isfile(self.metrics_file_path):
            with fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = next(csv.reader(file), [])


def csv_experiment(logger: CSVLogger, writer: Callable[[str], ExperimentWriter]) -> ExperimentWriter:
    """The body of `CSVLogger.experiment` with another writer: created once in `_experiment`, the cache that
    `finalize` reads to know whether there is anything to save (a public attribute of our own would leave the
    last metrics unsaved)."""
    if logger._experiment is None:
        get_filesystem(logger.root_dir).makedirs(logger.root_dir, exist_ok=True)
        logger._experiment = writer(logger.log_dir)
    return logger._experiment


# The file beside a DCP checkpoint's shards holding the rest of Lightning's checkpoint (what ModelParallelStrategy
# writes after its shards; the background save of glm46.lit.strategies writes it too).
DCP_CHECKPOINT_META = _METADATA_FILENAME
