"""The OmegaConf resolvers of the config tree: token arithmetic and the run directory's job id."""

from __future__ import annotations

import math
import os
import time

from omegaconf import DictConfig, OmegaConf

from glm46.lit.callbacks.preemption import slurm_job_id
from glm46.parallel.parallelize import policy_for_precision

_START = time.time()


def tokens(*factors: float) -> int:
    """`${tokens:a,b,...}`: a token count as the product of its factors (e.g. steps x global batch)."""
    return int(math.prod(factors))


def product(*factors: float) -> float:
    """`${product:a,b,...}`: a real-valued product (e.g. the optimizer's LR scaled by the phase's lr_scale)."""
    return float(math.prod(factors))


def steps(budget: float, *per_step: float) -> int:
    """`${steps:tokens,global_batch_tokens}`: optimizer steps to spend a token budget (rounded up)."""
    return math.ceil(budget / math.prod(per_step))


def data_parallel(num_nodes: int, devices: int, tensor_parallel: int = 1) -> int:
    """`${data_parallel:nodes,devices,tp}`: ranks that see different batches (tensor-parallel ranks share one)."""
    if (num_nodes * devices) % tensor_parallel:
        raise ValueError(
            f"world size cluster.num_nodes x cluster.devices = {num_nodes} x {devices} is not "
            f"divisible by parallelism.tensor_parallel={tensor_parallel}"
        )
    return num_nodes * devices // tensor_parallel


def accumulation(global_tokens: int, batch_size: int, seq_len: int, data_parallel_ranks: int) -> int:
    """`${accumulation:...}`: micro-batches per optimizer step so that a phase's global batch (tokens)
    is spread evenly over the data-parallel ranks; an uneven split fails at composition."""
    per_micro_step = batch_size * seq_len * data_parallel_ranks
    if global_tokens % per_micro_step:
        raise ValueError(
            f"phase.global_batch_tokens={global_tokens} is not divisible by data.batch_size x data.seq_len x "
            f"data-parallel ranks (cluster.num_nodes x cluster.devices / parallelism.tensor_parallel) = "
            f"{batch_size} x {seq_len} x {data_parallel_ranks} = {per_micro_step}"
        )
    return global_tokens // per_micro_step


def fsdp_policy(precision: str, mixed_precision: DictConfig) -> dict | None:
    """`${fsdp_policy:${trainer.precision},${..mixed_precision}}`: parallelism.mixed_precision when either dtype
    is set (glm46.app.checks refuses one that contradicts trainer.precision), else the policy trainer.precision
    implies (glm46.parallel.parallelize.policy_for_precision)."""
    explicit = OmegaConf.to_container(mixed_precision)
    return explicit if any(explicit.values()) else policy_for_precision(precision)


def matmul_dtype(precision: str) -> str:
    """`${matmul_dtype:${trainer.precision}}`: the dtype of Muon's Newton-Schulz iterations: bfloat16 when the run
    computes in bf16 (GLM's recipe on GPUs), float32 otherwise (on a CPU without bf16 units bf16 Newton-Schulz
    is 17x slower, measured)."""
    return "bfloat16" if str(precision).startswith("bf16") else "float32"


def job_id() -> str:
    """`${job_id:}`: the Slurm job (and array task) id, the same on every rank and across requeues;
    outside Slurm, the local start time and process id."""
    return slurm_job_id() or time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(_START)) + f"_{os.getpid()}"


def register_resolvers() -> None:
    """Register them (uncached: `${job_id:}` in a config pickled for a Slurm job resolves inside the job)."""
    for function in (tokens, product, steps, data_parallel, accumulation, fsdp_policy, matmul_dtype, job_id):
        OmegaConf.register_new_resolver(function.__name__, function, replace=True)
