"""Schemas of where and how a job runs: parallelism (the layout), cluster (the machines), paths."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


@dataclass
class MixedPrecision:
    """FSDP2's MixedPrecisionPolicy, by dtype name."""

    param_dtype: Optional[str] = None
    reduce_dtype: Optional[str] = None


@dataclass
class ParallelismConfig:
    """A parallel layout (glm46.parallel.layout). The sizes default to one process's: members set what differs."""

    name: str = MISSING
    engine: str = MISSING  # single | ddp | mesh | deepspeed
    strategy: Any = "auto"  # the Lightning strategy (a `_target_` node, or a Lightning name)
    data_parallel_shard: int = 1  # FSDP shard degree among data-parallel ranks; -1: all of them
    tensor_parallel: int = 1  # world size = data-parallel ranks x tensor_parallel
    sequence_parallel: bool = False  # with TP: the residual stream split over the sequence between TP regions
    expert_parallel: int = 1  # routed experts split over this many of the data-parallel ranks
    pipeline_parallel: int = 1  # stages the decoder is split into (torch.distributed.pipelining, engine=mesh)
    context_parallel: int = 1  # ranks each sequence is split over (engine=mesh); data.seq_len divisible by 2 x it
    pipeline_schedule: str = "1F1B"  # 1F1B | Interleaved1F1B | ZBVZeroBubble | DualPipeV | GPipe
    virtual_stages: int = 1  # stages per rank: 1 for 1F1B/GPipe, >= 2 for Interleaved1F1B, 2 for the V schedules
    microbatches: int = 1  # a rank's batch (data.batch_size) is split into this many for the pipeline
    layers_per_stage: Optional[List[int]] = None  # decoder layers of each stage, in order; null: balanced by cost
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (engine=mesh)
    # FSDP2's policy (engine=mesh); both null: the policy trainer.precision implies (glm46.config.resolvers.fsdp_policy)
    mixed_precision: MixedPrecision = field(default_factory=MixedPrecision)
    # Free each gathered layer after forward (ZeRO-3-like) or keep it to the backward (ZeRO-2-like). null:
    # torchtitan's default, true without pipeline parallelism, false under it (the stages would gather their layers
    # again for every microbatch; the zero-bubble schedules take the weights' gradients on the gathered weights).
    reshard_after_forward: Optional[bool] = None
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
