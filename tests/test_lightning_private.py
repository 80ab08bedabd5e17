"""The Lightning private members glm46.lightning_private relies on still exist and behave as it assumes.

A Lightning upgrade that renames, removes or changes one fails here, naming it, instead of deep inside a run.
"""

import inspect
import os

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

from glm46.lightning_private import (
    DeepSpeedInitializeHook,
    attach_device_mesh,
    init_model_parallel_processes,
    last_saved_step,
    save_last_checkpoint,
)
from glm46.lit.csv_logger import AppendingCSVLogger
from glm46.lit.strategies import DeepSpeedStrategy as GLMDeepSpeedStrategy

from .helpers import LinearModule


@pytest.mark.parametrize(
    "owner, name, parameters",
    [
        (ModelParallelStrategy, "_setup_distributed", ["self"]),
        (DeepSpeedStrategy, "_init_deepspeed_distributed", ["self"]),
        (DeepSpeedStrategy, "_setup_model_and_optimizer", ["self", "model", "optimizer", "lr_scheduler"]),
        (ModelCheckpoint, "_save_last_checkpoint", ["self", "trainer", "monitor_candidates"]),
        (ModelCheckpoint, "_monitor_candidates", ["self", "trainer"]),
        (ExperimentWriter, "_check_log_dir_exists", ["self"]),
    ],
)
def test_private_methods_keep_their_signatures(owner, name, parameters):
    method = getattr(owner, name, None)
    assert callable(method), f"Lightning {L.__version__}: {owner.__name__}.{name} is gone"
    assert list(inspect.signature(method).parameters) == parameters, f"{owner.__name__}.{name} changed signature"


def test_deepspeed_creates_the_training_engine_through_setup_model_and_optimizer():
    """DeepSpeedInitializeHook sees `deepspeed.initialize` only if Lightning still calls it from this method."""
    assert "self._setup_model_and_optimizer(" in inspect.getsource(DeepSpeedStrategy._initialize_deepspeed_train)
    assert inspect.signature(DeepSpeedStrategy._setup_model_and_optimizer).parameters["lr_scheduler"].default is None
    assert GLMDeepSpeedStrategy._setup_model_and_optimizer is DeepSpeedInitializeHook._setup_model_and_optimizer


def test_device_mesh_properties_read_the_attributes_attach_device_mesh_sets():
    strategy, module, mesh = ModelParallelStrategy(), L.LightningModule(), object()
    assert strategy._device_mesh is None and module._device_mesh is None
    strategy.connect(module)
    attach_device_mesh(strategy, mesh)
    assert strategy.device_mesh is mesh and module.device_mesh is mesh


@pytest.fixture
def one_process():
    """CPU, one process: the process group is torn down and the environment variables set for it restored."""
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already up in this process")
    environ = dict(os.environ)
    yield {
        "accelerator": CPUAccelerator(),
        "parallel_devices": [torch.device("cpu")],
        "cluster_environment": LightningEnvironment(),
    }
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


def test_setup_distributed_starts_the_process_group_without_a_mesh(one_process):
    strategy = ModelParallelStrategy()
    for name, value in one_process.items():
        setattr(strategy, name, value)
    init_model_parallel_processes(strategy)
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
    assert torch.distributed.get_backend() == "gloo" and strategy._device_mesh is None


def test_init_deepspeed_distributed_starts_the_process_group_and_the_hook_builds_the_engine(one_process):
    strategy = GLMDeepSpeedStrategy(config={"train_micro_batch_size_per_gpu": 1}, **one_process)
    strategy.setup_distributed()  # on CPU: glm46.lightning_private.init_deepspeed_processes
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
    model = torch.nn.Linear(2, 1)
    engine, _ = strategy._setup_model_and_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert type(engine).__name__ == "DeepSpeedEngine" and "zero_force_ds_cpu_optimizer" in strategy.config


def test_model_checkpoint_records_its_saved_step_and_saves_last_on_demand(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_last=True)
    assert last_saved_step(checkpoint) == 0
    trainer = L.Trainer(
        max_steps=6, callbacks=[checkpoint], logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(LinearModule(), train_dataloaders=torch.utils.data.DataLoader(torch.randn(64, 2), batch_size=2))
    assert last_saved_step(checkpoint) == 4
    last = tmp_path / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 4, (
        "Lightning now refreshes last.ckpt at the end of training: glm46's ModelCheckpoint.on_train_end may go"
    )

    save_last_checkpoint(checkpoint, trainer)
    assert last_saved_step(checkpoint) == 6 and checkpoint.last_model_path == str(last)
    assert torch.load(last, weights_only=False)["global_step"] == 6


def test_csv_logger_caches_its_writer_where_finalize_looks(tmp_path):
    logger = CSVLogger(tmp_path, name="run", version="v")
    assert logger._experiment is None
    assert logger.experiment is logger._experiment


def test_appending_csv_logger_keeps_the_metrics_of_the_previous_run(tmp_path):
    log_dir = tmp_path / "run" / "v"
    log_dir.mkdir(parents=True)
    (log_dir / "metrics.csv").write_text("loss,step\n3.0,0\n")
    logger = AppendingCSVLogger(tmp_path, name="run", version="v")
    logger.log_metrics({"loss": 2.0}, step=1)
    logger.finalize("success")  # saves only if `_experiment` holds the writer
    assert (log_dir / "metrics.csv").read_text().splitlines() == ["loss,step", "3.0,0", "2.0,1"]
