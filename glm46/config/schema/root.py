"""The schema of the whole composition (conf/config.yaml): the top-level keys and every group's type.

Groups with one shape are typed here; groups whose members differ in shape (model, optim, data, phase,
parallelism) are typed by each member's own schema (`defaults: [schema]` in its file), and `callbacks` and
`logger` are open dictionaries of typed entries, so `+callbacks.mine._target_=...` adds one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from glm46.sampling.filters import FilterSettings

from .data import PrepareConfig, SourceData
from .derive import target_schema
from .launch import ClusterConfig, PathsConfig
from .training import GuardConfig, PeftConfig, RecipeConfig, ScheduleConfig, TrainerConfig


class Task(StrEnum):
    train = "train"  # prepare the dataset if the experiment says so, then train (every stage of a curriculum)
    prepare = "prepare"  # read, deduplicate and filter `source`, train a tokenizer, write token shards
    estimate = "estimate"  # parameter counts
    plan = "plan"  # FLOPs, memory per GPU, tokens/s, days and cost of the composed job
    dryrun = "dryrun"  # one rank of the job at its real world size, on this CPU
    eval = "eval"  # lm-evaluation-harness on a trained model's weights (glm46.eval), offline
    serve = "serve"  # print and run the vLLM or SGLang command that serves an export (glm46.serve)
    export = "export"  # write a quantized copy of an export (FP8 for vLLM/SGLang, GGUF for llama.cpp)
    score = "score"  # a reward model's pairwise accuracy on prepared preference pairs (glm46.rl.score)
    sample = "sample"  # rejection sampling: candidates drawn, filtered, the best written as chat JSONL


class Engine(StrEnum):
    vllm = "vllm"
    sglang = "sglang"


class Device(StrEnum):
    gpu = "gpu"
    cpu = "cpu"


@dataclass
class Monitoring:
    prometheus_port: int = 0  # > 0: rank 0 serves the run's metrics for Prometheus (glm46.lit.callbacks.prometheus)
    prometheus_address: str = "0.0.0.0"


@dataclass
class DryRun:
    rank: int = 0  # the global rank simulated at the cluster's world size


@dataclass
class EvalConfig:
    """Settings of task=eval and of glm46.eval.evaluate (conf/eval/default.yaml explains each key)."""

    model: Optional[str] = None  # required by task=eval
    after_train: bool = False  # train evaluates its final weights (every stage of a curriculum)
    tasks: List[str] = MISSING
    include_path: Optional[str] = None
    benchmark_dir: Optional[str] = None  # local copies of lm-eval's benchmarks' data (glm46.eval.benchmarks)
    sandbox: str = "bubblewrap"  # where code benchmarks run their programs: bubblewrap, or none (glm46.sandbox)
    endpoint: Optional[str] = None  # an OpenAI-compatible server's base URL, ending in /v1 (glm46.eval.endpoint)
    endpoint_api: str = "completions"  # completions | chat
    endpoint_model: Optional[str] = None  # the served name; null: the first the server lists
    endpoint_tokenizer: Optional[str] = None  # the served model's HF folder (completions); null: eval.model's
    endpoint_concurrency: int = 4
    endpoint_timeout: int = 300  # seconds per request
    endpoint_retries: int = 3  # attempts per request, with exponential backoff
    dataset: str = MISSING
    tokenizer: Optional[str] = None
    val_fraction: float = MISSING
    domain_val_fraction: Dict[str, float] = field(default_factory=dict)
    limit: Optional[int] = None
    batch_size: int = MISSING
    max_gen_toks: int = MISSING
    gen_kwargs: Dict[str, Any] = field(default_factory=dict)  # in every generation task's generation_kwargs
    max_length: Optional[int] = None
    ppl_documents: int = MISSING
    ppl_chars: int = MISSING
    seed: int = MISSING


@dataclass
class ServeConfig:
    """Settings of task=serve (conf/serve/default.yaml explains each key)."""

    model: Optional[str] = None  # required by task=serve
    engine: Engine = Engine.vllm
    device: Device = Device.gpu
    tensor_parallel_size: int = 1
    mtp: bool = False
    speculative_steps: int = 1
    max_model_len: Optional[int] = None
    dtype: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: Optional[str] = None
    lora: Optional[str] = None  # a peft-format adapter served on top of serve.model (vLLM on GPUs)
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    python: Optional[str] = None
    env: Dict[str, Any] = field(default_factory=dict)
    extra_args: List[str] = field(default_factory=list)
    dry: bool = False


class ExportFormat(StrEnum):
    fp8 = "fp8"
    gguf = "gguf"


class GGUFType(StrEnum):
    f16 = "f16"
    q8_0 = "q8_0"
    q4_k_m = "q4_k_m"


@dataclass
class ExportConfig:
    """Settings of task=export (conf/export/default.yaml explains each key)."""

    model: Optional[str] = None  # required by task=export
    format: ExportFormat = ExportFormat.fp8
    output: Optional[str] = None  # required by task=export
    block_size: int = 128
    gguf_type: GGUFType = GGUFType.f16


class ScoreSplit(StrEnum):
    val = "val"
    all = "all"


@dataclass
class ScoreConfig:
    """Settings of task=score (conf/score/default.yaml explains each key)."""

    model: Optional[str] = None  # required by task=score
    data: Optional[str] = None  # required by task=score
    split: ScoreSplit = ScoreSplit.val
    val_fraction: float = 0.1
    seq_len: int = 2048
    batch_size: int = 16
    domains: Optional[List[str]] = None  # the domains of pairs (None: every domain of score.data)


class SampleKeep(StrEnum):
    best = "best"
    all = "all"


class SampleSplit(StrEnum):
    all = "all"
    train = "train"
    val = "val"


SampleFilters = target_schema(FilterSettings, path="glm46.sampling.filters.FilterSettings")


@dataclass
class SampleConfig:
    """Settings of task=sample (conf/sample/default.yaml explains each key)."""

    model: Optional[str] = None  # required by task=sample
    prompts: Optional[str] = None  # required by task=sample
    output: Optional[str] = None  # required by task=sample
    n: int = 8
    keep: SampleKeep = SampleKeep.best
    split: SampleSplit = SampleSplit.all
    val_fraction: float = 0.02
    domains: Optional[List[str]] = None
    limit: Optional[int] = None
    temperature: float = 1.0
    max_new_tokens: int = 256
    max_turns: int = 2
    max_turn_tokens: Optional[int] = None
    batch_size: int = 8
    reward_model: Optional[str] = None
    tasks: int = 1
    task: Optional[int] = None
    num_workers: int = 1
    threads: Optional[int] = None
    pass_rate: Optional[List[float]] = None  # [low, high]: the difficulty filter's bounds
    fail_first_k: Optional[int] = None  # with pass_rate: none of the first k candidates right (pass@k = 0)
    filters: SampleFilters = field(default_factory=SampleFilters)


@dataclass
class RunConfig:
    task: Task = Task.train
    seed: int = MISSING  # model init, data order and sampling
    ckpt_path: Optional[str] = None  # `last`: resume from the newest checkpoint in this run directory
    init_from: Optional[str] = None  # weights to start from (a .ckpt, an HF or DCP directory); fresh data state
    global_batch_tokens: int = MISSING  # tokens per optimizer step over all ranks (conf/config.yaml)
    dryrun: DryRun = field(default_factory=DryRun)
    monitoring: Monitoring = field(default_factory=Monitoring)
    stages: Optional[Dict[str, Optional[List[str]]]] = field(default_factory=dict)  # name -> overrides; null: skipped
    final_stage: Optional[str] = None  # the report's name for this composition, the last stage (default: phase.name)
    compare_stages: List[List[str]] = field(
        default_factory=list
    )  # more [before, after] stage pairs the report compares
    paths: PathsConfig = field(default_factory=PathsConfig)
    model: Any = MISSING
    module: Any = MISSING  # the LightningModule (conf/module: causal_lm, grpo)
    optim: Any = MISSING
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    source: Optional[SourceData] = None  # what task=prepare reads; train prepares it first when data reads it
    data: Any = MISSING
    phase: Any = MISSING
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    score: ScoreConfig = field(default_factory=ScoreConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    callbacks: Dict[str, Any] = field(default_factory=dict)
    guard: Optional[GuardConfig] = None
    peft: Optional[PeftConfig] = None  # conf/peft: lora | dora; null: full fine-tuning
    parallelism: Any = MISSING
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logger: Dict[str, Any] = field(default_factory=dict)
