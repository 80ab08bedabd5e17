"""The Lightning strategies the `parallelism` configs build (existing engines, thin subclasses):

- `MeshParallelStrategy`: Lightning's ModelParallelStrategy (FSDP2 + DTensor, user-applied in
  `configure_model`) with the 5-D device mesh of glm46.parallel.mesh instead of its 2-D one, so
  one strategy runs FSDP2, HSDP, tensor, expert, context and pipeline parallelism and their products. The
  LightningModule's `configure_model` calls `strategy.parallelize(model)`, then takes `strategy.model_step(model)`
  for its steps.
- `DeepSpeedStrategy`: Lightning's, also on CPU (gloo). As shipped it refuses any accelerator but
  CUDA and passes `device_rank=root_device.index` (None on CPU) to `deepspeed.initialize`; on CUDA
  this subclass behaves exactly as Lightning's.
"""

from __future__ import annotations

import argparse
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators.cuda import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.strategies import DeepSpeedStrategy as _LightningDeepSpeedStrategy

from glm46.checkpoint.background_save import BackgroundCheckpointWriter
from glm46.checkpoint.write_errors import write_failed
from glm46.lightning_private import (
    DCP_CHECKPOINT_META,
    DeepSpeedInitializeHook,
    attach_device_mesh,
    init_deepspeed_processes,
    init_model_parallel_processes,
)
from glm46.parallel.layout import Layout
from glm46.parallel.mesh import build_mesh
from glm46.parallel.model_step import ModelStep, PipelineStep
from glm46.parallel.parallelize import parallelize
from glm46.parallel.pipeline_parallel import Pipeline, split_model
from glm46.parallel.sharded_tokens import token_split


class MeshParallelStrategy(ModelParallelStrategy):
    """FSDP2 / HSDP x expert parallel x tensor parallel over one device mesh (see glm46.parallel.layout).

    layout: the sizes (glm46.parallel.Layout, built once from the `parallelism` node: build_strategy);
    activation_checkpointing: None, or how each decoder layer is recomputed ("full", "selective":
    glm46.parallel.checkpointing); mixed_precision: FSDP2's policy ({param_dtype,
    reduce_dtype} names, or None); save_distributed_checkpoint: DCP folders (True) or one full file written by
    rank 0; async_checkpoint: the DCP folders written by a background thread while training goes on.
    """

    def __init__(
        self,
        layout: Layout,
        activation_checkpointing: str | None = None,
        mixed_precision: dict | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        async_checkpoint: bool = False,
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=layout.tensor_parallel,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.layout = layout
        self.activation_checkpointing = activation_checkpointing
        self.mixed_precision = dict(mixed_precision) if mixed_precision else None
        self.stage_models: list[torch.nn.Module] = []  # this rank's pipeline stages (pipeline_parallel > 1)
        self.writer = BackgroundCheckpointWriter() if async_checkpoint and save_distributed_checkpoint else None

    def setup_environment(self) -> None:
        init_model_parallel_processes(self)
        if self.world_size != self.layout.world_size:
            raise RuntimeError(
                f"the job has {self.world_size} processes, its layout was built for {self.layout.world_size} "
                f"(cluster.num_nodes x cluster.devices)"
            )
        attach_device_mesh(self, build_mesh(self.layout, self.root_device.type))

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp = self.device_mesh["dp"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    @property
    def data_parallel_group(self) -> torch.distributed.ProcessGroup:
        """Ranks that see different batches (all but the tensor- and pipeline-parallel dims)."""
        return self.device_mesh["dp"].get_group()

    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        """Apply the layout to a plain GLM46ForCausalLM, in place (called from `configure_model`): under pipeline
        parallelism first keep only this rank's stages."""
        if self.layout.pipeline_parallel > 1:
            pp_rank = self.device_mesh["pp"].get_local_rank()
            self.stage_models = split_model(model, self.layout, pp_rank)
        return parallelize(
            model,
            self.layout,
            self.device_mesh,
            self.activation_checkpointing,
            self.mixed_precision,
            self.stage_models,
        )

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Lightning's DCP save, written in the background under async_checkpoint (glm46.checkpoint.background_save):
        the same folder, `meta.pt` first, DCP's `.metadata` (what makes the folder a checkpoint) last."""
        if self.writer is None:
            try:
                return super().save_checkpoint(checkpoint, filepath, storage_options)
            except BaseException as error:  # DCP's CheckpointException is a BaseException wrapping each rank's error
                if isinstance(error, (KeyboardInterrupt, SystemExit)) or not self._save_distributed_checkpoint:
                    raise
                failure = write_failed(Path(filepath), error)  # before the folder goes (the free space)
                if self.global_rank == 0:
                    shutil.rmtree(filepath, ignore_errors=True)
                raise failure from error
        path = Path(self.broadcast(filepath))
        self.writer.wait()  # the previous save is whole before this one starts
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        if self.global_rank == 0:
            torch.save(checkpoint, path / DCP_CHECKPOINT_META)
        self.writer.save(state, path)

    def teardown(self) -> None:
        if self.writer is not None:
            self.writer.wait()
        super().teardown()

    def model_step(self, model: torch.nn.Module) -> ModelStep:
        """This layout's per-step object (glm46.parallel.model_step), once the model is laid out and materialised:
        the pipeline schedule over this rank's stages, or the model's forward on this rank's tokens."""
        split = token_split(self.layout, self.device_mesh)
        folded = self.layout.experts_fold_tp
        if not self.stage_models:
            return ModelStep(model, split, folded)
        pipeline = Pipeline(self.stage_models, self.layout, self.device_mesh, self.root_device, split)
        return PipelineStep(model, pipeline, split, folded)


class DeepSpeedStrategy(DeepSpeedInitializeHook, _LightningDeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy, also on CPU (gloo); unchanged on CUDA.

    force_ds_cpu_optimizer: DeepSpeed's `zero_force_ds_cpu_optimizer`: with offload_optimizer, refuse any
    optimizer but DeepSpeed's CPU Adam (DeepSpeed's default, for speed); False lets a torch optimizer step
    the offloaded state.
    """

    def __init__(self, *args, force_ds_cpu_optimizer: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.force_ds_cpu_optimizer = force_ds_cpu_optimizer

    def _on_cpu(self) -> bool:
        return not isinstance(self.accelerator, CUDAAccelerator)

    def setup_environment(self) -> None:
        if not self._on_cpu():
            return super().setup_environment()
        DDPStrategy.setup_environment(self)  # without DeepSpeedStrategy's CUDA-only check

    def setup_distributed(self) -> None:
        if not self._on_cpu():
            return super().setup_distributed()
        reset_seed()  # CPU devices have no index to check against the local rank
        self.set_world_ranks()
        init_deepspeed_processes(self)

    def deepspeed_initialize(self, model, optimizer, lr_scheduler=None):
        """`deepspeed.initialize` for training (see DeepSpeedInitializeHook); on CPU `device_rank` is the local rank."""
        self.config.setdefault("zero_force_ds_cpu_optimizer", self.force_ds_cpu_optimizer)
        if self.zero_stage_3:
            register_external_parameters(model)
        if not self._on_cpu():
            return self.lightning_deepspeed_initialize(model, optimizer, lr_scheduler)
        import deepspeed

        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, deepspeed_optimizer


def register_external_parameters(module: torch.nn.Module) -> None:
    """ZeRO-3 gathers a weight in its own module's forward; a weight used elsewhere (`module.external_parameters()`,
    e.g. the lm_head in the chunked loss) is registered on the module DeepSpeed runs, so it is gathered
    for that module's forward and again for its backward."""
    import deepspeed

    for parameter in getattr(module, "external_parameters", list)():
        deepspeed.zero.register_external_parameter(module, parameter)


def build_strategy(parallelism: Any, layout: Layout) -> Strategy | str:
    """The Lightning strategy of a `parallelism` node: a Lightning name ("auto"), or its `strategy` node built,
    the mesh's with the job's Layout."""
    node = parallelism.strategy
    if isinstance(node, str):
        return node
    if parallelism.engine == "mesh":
        return instantiate(node, _partial_=True)(layout=layout)  # the Layout object itself, not a config copy
    return instantiate(node)
