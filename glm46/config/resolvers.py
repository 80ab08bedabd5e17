"""The OmegaConf resolvers of the config tree: token arithmetic, the recipe's clock, a prepared dataset's vocabulary and
mixture, and the run directory's job id."""

from __future__ import annotations

import math
import os
import time

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from glm46.config.dataset_info import checkpoint_field, dataset_mixture, dataset_vocab
from glm46.lit.callbacks.preemption import slurm_job_id
from glm46.optim.schedules import steps_for
from glm46.parallel.checkpointing import checkpointing_mode
from glm46.parallel.layout import data_parallel_size
from glm46.parallel.parallelize import fsdp_policy as parallel_fsdp_policy

_START = time.time()


def tokens(*factors: float) -> int:
    """`${tokens:a,b,...}`: a token count as the product of its factors (e.g. steps x global batch)."""
    return int(math.prod(factors))


def eq(a, b) -> bool:
    """`${eq:a,b}`: whether two values are equal (e.g. `${eq:${parallelism.engine},mesh}`)."""
    return a == b


def steps(budget: float, *per_step: float) -> int:
    """`${steps:tokens,global_batch_tokens}`: optimizer steps to spend a token budget (rounded up)."""
    return math.ceil(budget / math.prod(per_step))


def recipe_length(phases: DictConfig) -> int:
    """`${recipe_length:${.phases}}`: the recipe's clock, the tokens of all its phases."""
    return sum(int(tokens) for tokens in phases.values())


def recipe_start(phases: DictConfig, name: str) -> int:
    """`${recipe_start:${recipe.phases},${phase.name}}`: the tokens of the phases before `name` on the recipe's
    clock; 0 for a run the recipe does not list (a clock of its own)."""
    if name not in phases:
        return 0
    names = list(phases)
    return sum(int(phases[before]) for before in names[: names.index(name)])


def clock_scale(phases: DictConfig, name: str, *, _parent_: DictConfig) -> float:
    """`${clock_scale:${recipe.phases},${phase.name}}`: 1 for a phase on the recipe's clock; for any other run,
    its own tokens (`run_tokens` beside this key, read only then: a phase on the clock may take its step count from
    the schedule's positions) over the recipe's."""
    if name in phases:
        return 1.0
    return _parent_.run_tokens / recipe_length(phases)


def scaled(position: int, scale: float) -> int:
    """`${scaled:${recipe.warmup_tokens},${schedule.scale}}`: a position of the recipe's clock on this run's."""
    return int(position) if scale == 1 else round(position * scale)


def switch_at(position: int, scale: float, post_training: list[str], name: str) -> int:
    """`${switch_at:${recipe.switch_tokens},${schedule.scale},${recipe.post_training},${phase.name}}`: where the MTP
    weight and the balancer rate switch on this run's clock: the recipe's switch, scaled; 0 for a post-training
    phase (SFT, RL), which starts past it. After the first 15T tokens GLM-4.5 trains with the correction bias frozen
    and the MTP weight at 0.1, and fine-tuning that moved the bias again would move the routing the base model
    learned."""
    return 0 if name in post_training else scaled(position, scale)


def phase_steps(budget: int, ramp: DictConfig | None, start_tokens: int, global_tokens: int, accumulation: int) -> int:
    """`${phase_steps:${phase.tokens},<the batch warm-up's tokens_per_step or null>,${schedule.start_tokens},
    ${global_batch_tokens},${trainer.accumulate_grad_batches}}`: optimizer steps that spend the phase's tokens,
    counting the batch-size warm-up's smaller steps where the phase overlaps its ramp (glm46.optim.schedules)."""
    warmup = None if ramp is None else instantiate(ramp)
    return steps_for(budget, warmup, start_tokens, global_tokens // accumulation, accumulation)


def data_parallel(
    num_nodes: int, devices: int, tensor_parallel: int = 1, pipeline_parallel: int = 1, context_parallel: int = 1
) -> int:
    """`${data_parallel:nodes,devices,tp,pp,cp}`: ranks that see different batches (glm46.parallel.layout)."""
    return data_parallel_size(num_nodes * devices, tensor_parallel, pipeline_parallel, context_parallel)


def accumulation(global_tokens: int, batch_size: int, seq_len: int, data_parallel_ranks: int) -> int:
    """`${accumulation:...}`: micro-batches per optimizer step so that a phase's global batch (tokens)
    is spread evenly over the data-parallel ranks; an uneven split fails at composition."""
    per_micro_step = batch_size * seq_len * data_parallel_ranks
    if global_tokens % per_micro_step:
        raise ValueError(
            f"phase.global_batch_tokens={global_tokens} is not divisible by data.batch_size x data.seq_len x "
            f"data-parallel ranks (cluster.num_nodes x cluster.devices / (parallelism.tensor_parallel x "
            f"pipeline_parallel x context_parallel)) = "
            f"{batch_size} x {seq_len} x {data_parallel_ranks} = {per_micro_step}"
        )
    return global_tokens // per_micro_step


def fsdp_policy(precision: str, mixed_precision: DictConfig) -> dict | None:
    """`${fsdp_policy:${trainer.precision},${..mixed_precision}}`: parallelism.mixed_precision when either dtype
    is set (glm46.config.checks refuses one that contradicts trainer.precision), else the policy trainer.precision
    implies (glm46.parallel.parallelize.fsdp_policy)."""
    return parallel_fsdp_policy(precision, OmegaConf.to_container(mixed_precision))


def checkpointing(enabled: bool, mode: str) -> str | None:
    """`${checkpointing:${..activation_checkpointing},${..activation_checkpointing_mode}}`: None, "full" or
    "selective" (glm46.parallel.checkpointing)."""
    return checkpointing_mode(enabled, mode)


def ns_batch_bytes(memory_gib: float) -> int:
    """Muon's Newton-Schulz batch for a device of `memory_gib`: 1/64 of it, whole MiB, so that the workspace (up to
    6x the batch, glm46.optim.newton_schulz.workspace_bytes) stays under a tenth of the device."""
    return int(memory_gib * 1024 / 64) * 2**20


def matmul_dtype(precision: str) -> str:
    """`${matmul_dtype:${trainer.precision}}`: the dtype of Muon's Newton-Schulz iterations: bfloat16 when the run
    computes in bf16 (GLM's recipe on GPUs), float32 otherwise (on a CPU without bf16 units bf16 Newton-Schulz
    is 17x slower, measured)."""
    return "bfloat16" if str(precision).startswith("bf16") else "float32"


def references(source_domains, *cuts) -> list[str]:
    """`${references:${oc.select:source.reference_domains,[]},${.max}}`: a model-based filter's reference domains
    when none are given: the source's (edited prose, which the filter's model is fitted on) once one of its `cuts`
    is set, so that setting the cut turns the filter on; none (off) otherwise."""
    return list(source_domains) if any(cut is not None for cut in cuts) else []


def job_id() -> str:
    """`${job_id:}`: the Slurm job (and array task) id, the same on every rank and across requeues;
    outside Slurm, the local start time and process id."""
    return slurm_job_id() or time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(_START)) + f"_{os.getpid()}"


def job_dir() -> str:
    """`${job_dir:}`: a Slurm job's run directory under the sweep directory: `<array job>/<task>` for a task of a job
    array (a sweep's members side by side, as a local multirun's `<sweep>/<number>`), else the job id."""
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}/{os.environ['SLURM_ARRAY_TASK_ID']}"
    return job_id()


def register_resolvers() -> None:
    """Register them (uncached: `${job_id:}` in a config pickled for a Slurm job resolves inside the job)."""
    for function in (
        tokens,
        eq,
        steps,
        recipe_length,
        recipe_start,
        clock_scale,
        scaled,
        switch_at,
        phase_steps,
        data_parallel,
        accumulation,
        fsdp_policy,
        checkpointing,
        matmul_dtype,
        ns_batch_bytes,
        references,
        dataset_vocab,
        dataset_mixture,
        checkpoint_field,
        job_id,
        job_dir,
    ):
        OmegaConf.register_new_resolver(function.__name__, function, replace=True)
