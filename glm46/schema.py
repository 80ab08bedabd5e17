"""What Hydra needs before composing: structured-config schemas and OmegaConf resolvers.

`conf/model/*.yaml` start from `model/schema` (GLM46Config), so Hydra rejects a misspelt key or a
value of the wrong type while composing, naming the key.
"""

import math
import os
import time

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from glm46.modules import GLM46Config

_START = time.time()


def tokens(*factors: float) -> int:
    """`${tokens:a,b,...}`: a token count as the product of its factors (e.g. steps x batch x seq_len)."""
    return int(math.prod(factors))


def steps(budget: float, *per_step: float) -> int:
    """`${steps:tokens,batch,seq_len,...}`: optimizer steps to spend a token budget (rounded up)."""
    return math.ceil(budget / math.prod(per_step))


def accumulation(global_tokens: int, batch_size: int, seq_len: int, num_nodes: int, devices: int,
                 tensor_parallel: int = 1) -> int:
    """`${accumulation:...}`: micro-batches per optimizer step so that a phase's global batch (tokens)
    is spread evenly over the data-parallel ranks; an uneven split fails at composition."""
    if (num_nodes * devices) % tensor_parallel:
        raise ValueError(f"world size cluster.num_nodes x cluster.devices = {num_nodes} x {devices} is not "
                         f"divisible by parallelism.tensor_parallel={tensor_parallel}")
    data_parallel = num_nodes * devices // tensor_parallel
    per_micro_step = batch_size * seq_len * data_parallel
    if global_tokens % per_micro_step:
        raise ValueError(
            f"phase.global_batch_tokens={global_tokens} is not divisible by data.batch_size x data.seq_len x "
            f"data-parallel ranks (cluster.num_nodes x cluster.devices / parallelism.tensor_parallel) = "
            f"{batch_size} x {seq_len} x {data_parallel} = {per_micro_step}")
    return global_tokens // per_micro_step


def slurm_job_id() -> str | None:
    """The Slurm job id (`<array job>_<task>` for an array task), as scontrol takes it; None outside Slurm."""
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def job_id() -> str:
    """`${job_id:}`: the Slurm job (and array task) id, the same on every rank and across requeues;
    outside Slurm, the local start time and process id."""
    return slurm_job_id() or time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(_START)) + f"_{os.getpid()}"


def register_configs() -> None:
    ConfigStore.instance().store(group="model", name="schema", node=GLM46Config)
    OmegaConf.register_new_resolver("tokens", tokens, replace=True)
    OmegaConf.register_new_resolver("steps", steps, replace=True)
    OmegaConf.register_new_resolver("accumulation", accumulation, replace=True)
    OmegaConf.register_new_resolver("job_id", job_id, replace=True)  # not cached: a config pickled for a Slurm job resolves it there
