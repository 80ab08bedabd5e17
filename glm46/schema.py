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


def job_id() -> str:
    """`${job_id:}`: the Slurm job (and array task) id, the same on every rank and across requeues;
    outside Slurm, the local start time and process id."""
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    if "SLURM_JOB_ID" in os.environ:
        return os.environ["SLURM_JOB_ID"]
    return time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(_START)) + f"_{os.getpid()}"


def register_configs() -> None:
    ConfigStore.instance().store(group="model", name="schema", node=GLM46Config)
    OmegaConf.register_new_resolver("tokens", tokens, replace=True)
    OmegaConf.register_new_resolver("steps", steps, replace=True)
    OmegaConf.register_new_resolver("job_id", job_id, use_cache=True, replace=True)
