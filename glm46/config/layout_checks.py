"""The parallel layout against the model, the optimizer, the cluster, the data, the installed engines and the memory."""

from __future__ import annotations

import importlib.util

import torch
from omegaconf import DictConfig

from glm46.errors import ConfigError
from glm46.modules import GLM46Config, cuda_kernels
from glm46.optim.muon import is_muon
from glm46.parallel.layout import Layout, model_problems
from glm46.planning.sizing import composed_layout, composed_plan

from .values import check_at_least_one


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
    cp, accelerator = cfg.parallelism.context_parallel, cfg.cluster.accelerator
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


def check_memory(cfg: DictConfig, config: GLM46Config) -> None:
    """On GPUs: the plan's memory per GPU fits the cluster's (glm46.planning.plan)."""
    if cfg.cluster.accelerator == "gpu":
        result = composed_plan(cfg, config)[0]
        if not result["fits"]:
            raise ConfigError(f"cluster={cfg.cluster.name}, parallelism={cfg.parallelism.name}: " + result["notes"][-1])
