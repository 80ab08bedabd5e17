"""The composed job's hardware, parallel layout and plan (glm46.planning.plan), read from the config."""

from __future__ import annotations

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from glm46.modules import GLM46Config
from glm46.optim.muon import is_muon
from glm46.optim.schedules import accumulation_for
from glm46.parallel.checkpointing import checkpointing_mode
from glm46.parallel.layout import Layout
from glm46.peft.settings import peft_settings
from glm46.planning.plan import Hardware, plan
from glm46.planning.rollout import add_colocated_engine


def composed_layout(cfg: DictConfig) -> Layout:
    """The job's Layout: the `parallelism` node on cluster.num_nodes x cluster.devices processes."""
    return Layout.from_config(cfg.parallelism, cfg.cluster.num_nodes * cfg.cluster.devices)


def hardware_and_layout(cfg: DictConfig) -> tuple[Hardware, Layout]:
    cluster = cfg.cluster
    hardware = Hardware(
        cluster.num_nodes,
        cluster.devices,
        cluster.gpu.name,
        cluster.gpu.memory_gib,
        cluster.gpu.bf16_tflops,
        cluster.mfu,
        cluster.price_per_gpu_hour,
    )
    return hardware, composed_layout(cfg)


def accumulation_range(cfg: DictConfig, layout: Layout) -> tuple[int, int]:
    """The job's gradient accumulation at its smallest step and its largest: what the batch-size warm-up
    (callbacks.batch_size_warmup, glm46.lit.callbacks.BatchSizeWarmup) asks for where the phase starts on the
    recipe's clock, and trainer.accumulate_grad_batches."""
    full = cfg.trainer.accumulate_grad_batches
    warmup = cfg.callbacks.get("batch_size_warmup")
    if warmup is None:
        return full, full
    batch_tokens = cfg.data.batch_size * cfg.data.seq_len * layout.data_parallel
    first = accumulation_for(instantiate(warmup.tokens_per_step), cfg.schedule.start_tokens, batch_tokens)
    return min(first, full), full


def composed_plan(cfg: DictConfig, config: GLM46Config) -> tuple[dict, Hardware, Layout]:
    """glm46.planning.plan of the composed model, phase, layout and cluster, and of `peft`'s adapters on the frozen
    base when set (which train in AdamW's group whatever the optimizer: GLM46LitModule.param_groups)."""
    hardware, layout = hardware_and_layout(cfg)
    peft = peft_settings(cfg)
    optimizer = "muon" if is_muon(cfg.optim.optimizer._target_) and peft is None else "adamw"
    newton_schulz = {}
    if optimizer == "muon":
        newton_schulz = {
            "ns_batch_bytes": cfg.optim.ns_batch_bytes,
            "ns_dtype": getattr(torch, cfg.optim.optimizer.ns_dtype),
        }
    result = plan(
        config,
        layout,
        hardware,
        float(cfg.phase.tokens),
        cfg.data.seq_len,
        cfg.data.batch_size,
        optimizer,
        checkpointing_mode(cfg.parallelism.activation_checkpointing, cfg.parallelism.activation_checkpointing_mode),
        accumulation=accumulation_range(cfg, layout),
        peft=peft,
        **newton_schulz,
    )
    rollout = cfg.phase.get("rollout")
    if rollout is not None and rollout.engine == "vllm" and rollout.colocate:
        add_colocated_engine(result, config, rollout, hardware)
    return result, hardware, layout
