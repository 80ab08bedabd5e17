"""Schemas of where and how a job runs: parallelism (the layout), cluster (the machines), paths."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, make_dataclass
from dataclasses import fields as dataclass_fields
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from glm46.parallel.layout import Layout

from .derive import omegaconf_type


@dataclass
class MixedPrecision:
    """FSDP2's MixedPrecisionPolicy, by dtype name."""

    param_dtype: Optional[str] = None
    reduce_dtype: Optional[str] = None


def layout_fields() -> list[tuple[str, Any, Any]]:
    """The fields of glm46.parallel.Layout but world_size, as schema fields: the sizes and switches are declared
    once, there. The engine has no default here: each member of the group names its own."""
    hints = typing.get_type_hints(Layout)
    derived = []
    for item in dataclass_fields(Layout):
        if item.name == "world_size":
            continue
        default = MISSING if item.name == "engine" else item.default
        derived.append((item.name, omegaconf_type(hints[item.name]), field(default=default)))
    return derived


LayoutSizes = make_dataclass("LayoutSizes", layout_fields())


@dataclass
class ParallelismConfig(LayoutSizes):
    """A parallel layout: glm46.parallel.Layout's sizes and switches (LayoutSizes, one process's by default: members
    set what differs), and how the strategy runs it."""

    name: str = MISSING
    strategy: Any = "auto"  # the Lightning strategy (a `_target_` node, or a Lightning name)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (engine=mesh)
    # full: each layer whole from its input; selective: the matmuls' and attention's outputs kept, the cheap ops
    # between them recomputed (glm46.parallel.checkpointing)
    activation_checkpointing_mode: str = "full"
    # FSDP2's policy (engine=mesh); both null: the policy trainer.precision implies (glm46.config.resolvers.fsdp_policy)
    mixed_precision: MixedPrecision = field(default_factory=MixedPrecision)
    # How long a rank waits in a collective (and at start-up, for the others to join) before it fails: the
    # process-group timeout of every multi-process strategy. 600 s (torch's NCCL default; Lightning passes 30 min)
    # is above the longest wait a healthy run has (every rank writing its checkpoint or hf/ files, DeepSpeed's
    # first extension build, about 2 min) and frees a job whose rank hangs 20 min sooner. A rank that exits
    # ends the job at once (Lightning's launcher, Slurm's --kill-on-bad-exit); this bounds a rank that hangs.
    timeout_s: int = 600
    # engine=mesh: each DCP checkpoint is staged to host memory and written by a background thread while training
    # goes on (glm46.checkpoint.background_save); the next save and the end of training wait for it.
    async_checkpoint: bool = False


@dataclass
class DeepSpeedParallelism(ParallelismConfig):
    stage: int = MISSING
    offload_optimizer: bool = MISSING
    offload_parameters: bool = MISSING
    offload_device: str = MISSING  # cpu | nvme
    nvme_path: str = MISSING
    force_deepspeed_cpu_optimizer: bool = MISSING


@dataclass
class GPUConfig:
    """What task=plan and the memory check assume about one device."""

    name: str = MISSING
    memory_gib: float = MISSING
    bf16_tflops: float = MISSING


@dataclass
class ClusterConfig:
    """The machines. Slurm keys (partition ... setup) are read by the launcher when scheduler=slurm."""

    name: str = MISSING
    scheduler: str = MISSING  # none | slurm
    num_nodes: int = MISSING
    devices: int = MISSING  # per node: Slurm tasks per node and the Trainer's devices
    accelerator: str = MISSING
    gpu: GPUConfig = field(default_factory=GPUConfig)
    mfu: float = MISSING  # assumed model FLOP utilisation for task=plan
    price_per_gpu_hour: float = MISSING
    deterministic: Any = MISSING  # trainer.deterministic on this cluster: true | false | "warn"
    gpus_per_node: Optional[int] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    cpus_per_task: Optional[int] = None
    mem_gb: Optional[int] = None
    time_min: Optional[int] = None
    signal_delay_s: Optional[int] = None  # Slurm sends SIGUSR1 this long before the time limit
    max_restarts: int = 0  # a failed Slurm job requeues itself this many times at most (glm46.app.restart)
    restarts_without_progress: int = 1  # ... and this many times in a row without a new checkpoint
    sbatch: Dict[str, Any] = field(default_factory=dict)  # extra #SBATCH flags
    env: Dict[str, Any] = field(default_factory=dict)  # exported before srun
    setup: List[str] = field(default_factory=list)  # shell lines run before srun


@dataclass
class PathsConfig:
    cache_dir: str = MISSING  # prepared datasets (the embedded corpus) live here, shared by runs
    output_dir: str = MISSING  # local run directories: <output_dir>/<task>/<job id>
    sweep_dir: str = MISSING  # Slurm and sweep run directories: <sweep_dir>/<task>/<job id>
