"""A parallel layout: how `world_size` processes split into data, expert and tensor parallel groups.

Sizes (the `parallelism` config group's keys):
- `tensor_parallel` (tp): attention heads, KV heads and dense/shared MLPs split over tp ranks
  (Megatron column/row parallel through torch's `parallelize_module`); with `sequence_parallel` the residual stream
  between them is split over the sequence (glm46.parallel.sequence_parallel);
- data parallelism takes the rest: dp = world_size / tp ranks see different batches;
  `data_parallel_shard` of them shard parameters, gradients and optimizer state (FSDP2), and the
  dp / data_parallel_shard shard groups replicate each other (HSDP; 1 = replicate only, DDP-like);
- `expert_parallel` (ep): the routed experts are split over ep ranks, which exchange tokens all-to-all.
  Without TP the ep ranks are carved out of the data-parallel ranks (ep divides dp). With TP they span whole
  TP groups (Megatron's MoE parallel folding; torchtitan's expert-tensor-parallel degree 1): the TP ranks of a
  group, which hold the same tokens, each send 1/tp of them to the experts, so experts are split over TP
  instead of replicated on it; ep / tp of the ep ranks then come from the data-parallel ranks. The ranks
  holding the same experts (their data-parallel degree) are dp x tp / ep;
- `pipeline_parallel` (pp): the decoder split into pp x `virtual_stages` stages (torch.distributed.pipelining,
  glm46.parallel.pipeline_parallel), the outermost mesh dim as in torchtitan; the pp ranks of one pipeline see the same
  batch, split into `microbatches` by the schedule (`pipeline_schedule`);
- `context_parallel` (cp): each of cp ranks holds 1/cp of every sequence (glm46.parallel.context_parallel); they see
  the same batch and hold the same weights, which FSDP2 shards over the data-parallel shard ranks and the cp ranks
  together (torchtitan's dp_shard_cp). Its mesh dim lies between the data-parallel ones and tp. With expert
  parallelism the ep groups span the cp ranks first (as torchtitan borrows EP from dp_shard x cp): ep is a
  multiple of cp (of cp x tp when folded over TP).
dp = world_size / (tp x pp x cp).

`Layout.from_config` checks the layout's own rules (sizes, world size, what each engine can split);
`model_problems` the model against it (glm46.config.checks runs both before anything is queued).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from glm46.errors import ConfigError
from glm46.modules.config import GLM46Config

from .checkpointing import MODES

ENGINES = ("single", "ddp", "mesh", "deepspeed")
MESH_DIMS = ("pp", "edp_replicate", "ep_replicate", "edp_shard", "ep_shard", "cp", "tp")
# torch.distributed.pipelining's schedules by name -> stages per rank (None: `virtual_stages`, at least 2)
PIPELINE_SCHEDULES = {"1F1B": 1, "GPipe": 1, "Interleaved1F1B": None, "ZBVZeroBubble": 2, "DualPipeV": 2}
# Two stages per rank in a V (rank r runs stages r and 2 pp - 1 - r), the backward split into the inputs' gradients
# and, later, the weights' (zero-bubble)
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Layout:
    """The one object that says how a job is laid out, as torchtitan's ParallelDims: its fields (all but world_size,
    which the cluster gives) are the `parallelism` config group's keys (glm46.config.schema.launch derives the
    schema from them, so each is declared here once, with its default); built once from the composed node
    (`Layout.from_config`, which checks it) and handed to the strategy, the plan, the dry run and the checks."""

    world_size: int  # cluster.num_nodes x cluster.devices
    tensor_parallel: int = 1  # attention heads and dense MLPs split over this many ranks
    expert_parallel: int = 1  # routed experts split over this many ranks
    data_parallel_shard: int = 1  # FSDP shard degree among data-parallel ranks; -1 (config): all of them
    pipeline_parallel: int = 1  # stages the decoder is split into (torch.distributed.pipelining, engine=mesh)
    engine: str = "mesh"  # single | ddp | mesh | deepspeed
    pipeline_schedule: str = "1F1B"  # 1F1B | Interleaved1F1B | ZBVZeroBubble | DualPipeV | GPipe
    virtual_stages: int = 1  # stages per rank: 1 for 1F1B/GPipe, >= 2 for Interleaved1F1B, 2 for the V schedules
    microbatches: int = 1  # a rank's batch (data.batch_size) is split into this many for the pipeline
    layers_per_stage: tuple[int, ...] | None = None  # decoder layers of each stage, in order; None: balanced by cost
    # Free each gathered layer after forward (ZeRO-3-like) or keep it to the backward (ZeRO-2-like). None:
    # torchtitan's default, true without pipeline parallelism, false under it (the stages would gather their layers
    # again for every microbatch; the zero-bubble schedules take the weights' gradients on the gathered weights).
    reshard_after_forward: bool | None = None
    sequence_parallel: bool = False  # with TP: the residual stream split over the sequence between TP regions
    context_parallel: int = 1  # ranks each sequence is split over (engine=mesh); data.seq_len divisible by 2 x it

    @classmethod
    def from_config(cls, parallelism: Any, world_size: int) -> Layout:
        """The layout of a `parallelism` node (schema glm46.config.schema.launch.ParallelismConfig) on `world_size`
        processes; ConfigError naming the keys and values when the sizes cannot run together."""
        problems = layout_problems(parallelism, world_size)
        if problems:
            raise ConfigError(f"parallelism={parallelism.name}: " + "; ".join(problems))
        values = {f.name: parallelism[f.name] for f in fields(cls) if f.name != "world_size"}
        if values["data_parallel_shard"] == -1:
            values["data_parallel_shard"] = data_parallel_size(
                world_size, values["tensor_parallel"], values["pipeline_parallel"], values["context_parallel"]
            )
        values["layers_per_stage"] = tuple(values["layers_per_stage"]) if values["layers_per_stage"] else None
        return cls(world_size, **values)

    @property
    def data_parallel(self) -> int:
        """Ranks that see different batches: all but the tensor-, pipeline- and context-parallel ones."""
        return data_parallel_size(self.world_size, self.tensor_parallel, self.pipeline_parallel, self.context_parallel)

    @property
    def reshards_after_forward(self) -> bool:
        """Whether FSDP2 frees each gathered layer after its forward: as set, else torchtitan's default, yes without
        pipeline parallelism and no under it (a stage keeps its layers gathered across its microbatches)."""
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return self.pipeline_parallel == 1

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel * self.virtual_stages

    @property
    def data_parallel_replicate(self) -> int:
        return self.data_parallel // self.data_parallel_shard

    @property
    def experts_fold_tp(self) -> bool:
        """Whether the ep groups span the tensor-parallel ranks (MoE parallel folding): with both TP and EP."""
        return self.tensor_parallel > 1 and self.expert_parallel > 1

    @property
    def expert_parallel_dp(self) -> int:
        """How many data-parallel coordinates one ep group spans: ep, divided by tp when the groups fold over TP and
        by cp when they span the context-parallel ranks."""
        return self.expert_parallel // self.expert_parallel_inner

    @property
    def expert_parallel_inner(self) -> int:
        """The ranks of an ep group that are not data-parallel: its cp ranks and, folded over TP, its tp ranks (1
        without EP)."""
        if self.expert_parallel == 1:
            return 1
        return self.context_parallel * (self.tensor_parallel if self.experts_fold_tp else 1)

    @property
    def expert_data_parallel(self) -> int:
        """Ranks holding the same experts (they average the experts' gradients)."""
        return self.data_parallel // self.expert_parallel_dp

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP2 shards a dense weight over: the data-parallel shard ranks and the cp ranks (dp_shard_cp)."""
        return self.data_parallel_shard * self.context_parallel

    @property
    def shards_weights(self) -> bool:
        """Whether FSDP2 runs: ranks beside TP and EP that hold the same weights (data- or context-parallel)."""
        return self.data_parallel * self.context_parallel > 1

    @property
    def mesh_shape(self) -> tuple[int, int, int, int, int, int, int]:
        """Sizes of MESH_DIMS. The data-parallel ranks are (replicate x shard); ep takes the innermost
        expert_parallel_dp of them: from inside the shard groups when it divides data_parallel_shard, otherwise
        all of each shard group and expert_parallel_dp / data_parallel_shard shard groups (folded over TP,
        glm46.parallel.mesh adds the tp dim to the ep group)."""
        shard, replicate, ep = self.data_parallel_shard, self.data_parallel_replicate, self.expert_parallel_dp
        pp, tp, cp = self.pipeline_parallel, self.tensor_parallel, self.context_parallel
        if shard % ep == 0:
            return (pp, replicate, 1, shard // ep, ep, cp, tp)
        outer = ep // shard
        return (pp, replicate // outer, outer, 1, shard, cp, tp)


def product(*sizes: tuple[str, int]) -> str:
    """'tensor_parallel x context_parallel = 2 x 2' of the sizes that split (tensor_parallel always)."""
    shown = [(k, v) for k, v in sizes if v > 1 or k == "tensor_parallel"]
    if len(shown) == 1:
        return f"parallelism.{shown[0][0]}={shown[0][1]}"
    return " x ".join(k for k, _ in shown) + " = " + " x ".join(str(v) for _, v in shown)


def data_parallel_size(
    world_size: int, tensor_parallel: int = 1, pipeline_parallel: int = 1, context_parallel: int = 1
):
    """Ranks that see different batches: the world size over the ranks that share one (tensor-parallel ranks, the
    stages of one pipeline, the context-parallel ranks); a ConfigError when they do not divide it. The one place
    this is computed: Layout.data_parallel and the configs' `${data_parallel:...}` resolver read it."""
    shared = (("tensor_parallel", tensor_parallel), ("pipeline_parallel", pipeline_parallel))
    shared += (("context_parallel", context_parallel),)
    if world_size % (tensor_parallel * pipeline_parallel * context_parallel):
        raise ConfigError(
            f"world size {world_size} (cluster.num_nodes x cluster.devices) must be divisible by {product(*shared)}"
        )
    return world_size // (tensor_parallel * pipeline_parallel * context_parallel)


def layout_problems(parallelism: Any, world_size: int) -> list[str]:
    """What keeps the sizes and switches of a `parallelism` node from running on `world_size` processes (empty:
    nothing). Checked in order, each group of rules only once the one before it holds."""
    engine, tp, ep = parallelism.engine, parallelism.tensor_parallel, parallelism.expert_parallel
    pp, shard = parallelism.pipeline_parallel, parallelism.data_parallel_shard
    cp = parallelism.context_parallel
    basics = [
        (engine in ENGINES, f"parallelism.engine={engine!r} is not one of {list(ENGINES)}"),
        *(
            (value >= 1, f"parallelism.{key}={value!r} must be an integer >= 1")
            for key, value in (
                ("tensor_parallel", tp),
                ("expert_parallel", ep),
                ("pipeline_parallel", pp),
                ("context_parallel", cp),
            )
        ),
        (
            shard >= 1 or shard == -1,
            f"parallelism.data_parallel_shard={shard!r} must be an integer >= 1, or -1 for all data-parallel ranks",
        ),
        (world_size >= 1, f"world size {world_size!r} must be an integer >= 1"),
    ]
    engines = [
        (
            pp == 1 or engine == "mesh",
            f"parallelism.pipeline_parallel={pp} needs engine=mesh (fsdp2, tp, ep, production): "
            f"engine={engine} cannot split the layers into stages",
        ),
        (
            engine == "mesh" or (tp == 1 and ep == 1),
            f"parallelism.engine={engine} cannot split tensors or experts: tensor_parallel="
            f"{tp}, expert_parallel={ep} need engine=mesh (parallelism=tp, ep, fsdp2_ep)",
        ),
        (
            engine == "mesh" or shard in (1, -1) or engine == "deepspeed",
            f"parallelism.engine={engine} has no data_parallel_shard={shard} (use engine=mesh for HSDP)",
        ),
        (
            parallelism.get("activation_checkpointing_mode", "full") in MODES,
            f"parallelism.activation_checkpointing_mode={parallelism.get('activation_checkpointing_mode')}: one of "
            f"{', '.join(MODES)}",
        ),
        (
            not parallelism.activation_checkpointing or engine == "mesh",
            f"parallelism.activation_checkpointing=true is applied by engine=mesh (fsdp2, ep, tp, ...), not {engine}",
        ),
        (
            not parallelism.sequence_parallel or (engine == "mesh" and tp > 1),
            f"parallelism.sequence_parallel=true splits the sequence over the tensor-parallel ranks: it needs "
            f"engine=mesh with tensor_parallel > 1 (here {tp})",
        ),
        (
            cp == 1 or engine == "mesh",
            f"parallelism.context_parallel={cp} splits the sequence over ranks of the device mesh: it needs "
            f"engine=mesh (fsdp2, tp, ep, ...), not {engine}",
        ),
        (
            cp == 1 or pp == 1,
            f"parallelism.context_parallel={cp} with pipeline_parallel={pp}: the pipeline stages send whole "
            f"sequences, they do not split them over cp ranks yet; use one of the two",
        ),
        (
            engine != "single" or world_size == 1,
            f"parallelism=single runs one process, but the cluster has world size {world_size} "
            f"(cluster.num_nodes x cluster.devices): choose ddp, fsdp2, ... or devices=1",
        ),
    ]
    for rules in (basics, engines, pipeline_problems(parallelism) if pp > 1 else []):
        problems = [message for ok, message in rules if not ok]
        if problems:
            return problems

    outer = (("tensor_parallel", tp), ("pipeline_parallel", pp), ("context_parallel", cp))
    try:
        dp = data_parallel_size(world_size, tp, pp, cp)
    except ConfigError as error:
        return [str(error)]
    if tp > 1 and ep > 1 and ep % tp:
        return [
            f"parallelism.expert_parallel={ep} must be a multiple of tensor_parallel={tp}: the experts fold over "
            f"the tensor-parallel ranks, so an ep group is whole tp groups"
        ]
    inner = cp * (tp if tp > 1 else 1)  # Layout.expert_parallel_inner
    if cp > 1 and ep > 1 and ep % inner:
        return [
            f"parallelism.expert_parallel={ep} must be a multiple of {product(*outer[::2])} = {inner}: an ep group "
            f"spans whole context-parallel groups{' and tp groups' if tp > 1 else ''}"
        ]
    ep_dp = ep // inner if ep > 1 else ep  # Layout.expert_parallel_dp
    resolved = dp if shard == -1 else shard
    sizes = [
        (
            dp % ep_dp == 0,
            f"world size {world_size} must be divisible by {product(*outer, ('expert_parallel', ep))} = "
            f"{tp * pp * cp * ep} (experts are split over ep of the {dp} data-parallel ranks)"
            if ep_dp == ep
            else f"the {dp} data-parallel ranks (world size {world_size} / ({product(*outer)})) "
            f"must be divisible by expert_parallel / tensor_parallel = {ep} / {tp} = {ep_dp} (the ep groups fold "
            f"over the tp ranks and take {ep_dp} data-parallel ranks each)",
        ),
        (
            engine != "mesh" or dp % resolved == 0,
            f"parallelism.data_parallel_shard={shard} must divide the data-parallel size world size / "
            f"({product(*outer)}) = {world_size} / {tp * pp * cp} = {dp}",
        ),
        (
            engine != "mesh" or dp % resolved or dp % ep_dp or resolved % ep_dp == 0 or ep_dp % resolved == 0,
            f"parallelism.expert_parallel={ep} and data_parallel_shard={resolved} must divide one another "
            f"(ep groups lie inside a shard group, or span whole shard groups)"
            if ep_dp == ep
            else f"expert_parallel / tensor_parallel = {ep_dp} and data_parallel_shard={resolved} must divide one "
            f"another (ep groups lie inside a shard group, or span whole shard groups)",
        ),
    ]
    mixed = parallelism.mixed_precision
    if mixed and (mixed.param_dtype or mixed.reduce_dtype):
        sizes += [
            (value in (None, *DTYPES), f"parallelism.mixed_precision.{key}={value!r} is not one of {list(DTYPES)}")
            for key, value in (("param_dtype", mixed.param_dtype), ("reduce_dtype", mixed.reduce_dtype))
        ]
        sizes.append(
            (
                engine == "mesh",
                f"parallelism.mixed_precision is FSDP2's policy (engine=mesh); engine={engine} takes trainer.precision",
            )
        )
    if engine == "deepspeed":
        sizes.append(
            (parallelism.stage in (1, 2, 3), f"parallelism.stage={parallelism.stage!r} must be a ZeRO stage 1, 2 or 3")
        )
    return [message for ok, message in sizes if not ok]


def pipeline_problems(parallelism: Any) -> list[tuple[bool, str]]:
    """The rules of a pipeline's own keys: a schedule torch has, its stages per rank, enough microbatches."""
    pp, schedule = parallelism.pipeline_parallel, parallelism.pipeline_schedule
    virtual, microbatches = parallelism.virtual_stages, parallelism.microbatches
    if schedule not in PIPELINE_SCHEDULES:
        return [(False, f"parallelism.pipeline_schedule={schedule!r} is not one of {list(PIPELINE_SCHEDULES)}")]
    per_rank = PIPELINE_SCHEDULES[schedule]
    stages = pp * virtual
    return [
        (
            virtual == per_rank if per_rank else virtual >= 2,
            f"parallelism.virtual_stages={virtual}: pipeline_schedule={schedule} runs "
            + (f"{per_rank} stage(s) per rank" if per_rank else "2 or more stages per rank"),
        ),
        (
            schedule == "GPipe" or microbatches >= pp,
            f"parallelism.microbatches={microbatches} must be >= pipeline_parallel={pp} for {schedule} (fewer "
            f"microbatches than stages leave stages idle the whole step)",
        ),
        (
            schedule != "Interleaved1F1B" or microbatches % pp == 0,
            f"parallelism.microbatches={microbatches} must be a multiple of pipeline_parallel={pp} for "
            f"Interleaved1F1B (it runs the microbatches in rounds of pp)",
        ),
        (
            schedule not in V_SCHEDULES or microbatches >= stages,
            f"parallelism.microbatches={microbatches} must be >= the {stages} stages for {schedule}",
        ),
        (
            schedule not in V_SCHEDULES or not parallelism.reshard_after_forward,
            f"parallelism.reshard_after_forward=true: {schedule} takes the weights' gradients after the inputs', "
            f"on the gathered weights, which FSDP2 would have freed (measured: those gradients are lost); leave it "
            f"null or false",
        ),
    ]


def model_problems(layout: Layout, model: GLM46Config) -> list[str]:
    """What keeps `model` from being split by `layout`: heads, widths and experts against the tensor and expert
    parallel sizes."""
    tp, ep = layout.tensor_parallel, layout.expert_parallel
    shared = model.moe_intermediate_size * model.n_shared_experts
    rules = [
        (
            model.num_attention_heads % tp == 0,
            f"model.num_attention_heads={model.num_attention_heads} must be divisible by "
            f"parallelism.tensor_parallel={tp}",
        ),
        (
            model.num_key_value_heads % tp == 0,
            f"model.num_key_value_heads={model.num_key_value_heads} must be divisible by "
            f"parallelism.tensor_parallel={tp}",
        ),
        (
            model.first_k_dense_replace == 0 or model.intermediate_size % tp == 0,
            f"model.intermediate_size={model.intermediate_size} must be divisible by parallelism.tensor_parallel={tp}",
        ),
        (
            shared % tp == 0,
            f"the shared experts' width model.moe_intermediate_size x n_shared_experts = {shared} "
            f"must be divisible by parallelism.tensor_parallel={tp}",
        ),
        (
            model.n_routed_experts % ep == 0,
            f"model.n_routed_experts={model.n_routed_experts} must be divisible by parallelism.expert_parallel={ep}",
        ),
        (ep == 1 or model.has_moe, f"parallelism.expert_parallel={ep} but the model has no MoE layer"),
    ]
    if layout.pipeline_parallel > 1:
        rules += stage_problems(layout, model)
    return [message for ok, message in rules if not ok]


def stage_problems(layout: Layout, model: GLM46Config) -> list[tuple[bool, str]]:
    """The decoder layers against the stages: every stage needs at least one, and an explicit split must add up."""
    stages, layers, split = layout.num_stages, model.num_hidden_layers, layout.layers_per_stage
    if split is None:
        return [
            (
                layers >= stages,
                f"model.num_hidden_layers={layers} do not split into pipeline_parallel x virtual_stages = "
                f"{layout.pipeline_parallel} x {layout.virtual_stages} = {stages} stages of at least one layer",
            )
        ]
    return [
        (
            len(split) == stages and sum(split) == layers and min(split) >= 1,
            f"parallelism.layers_per_stage={list(split)} must give each of the {stages} stages at least one layer "
            f"and add up to model.num_hidden_layers={layers}",
        )
    ]


# ---------------------------------------------------------------- what each parameter is split by

# the tensors tensor parallelism splits, an adapter's (glm46.peft) with its base weight's rows or inputs
_COLUMN_PARALLEL = re.compile(
    r"\.(self_attn\.[qkv]_proj|mlp\.(shared_experts\.)?(gate|up)_proj)"
    r"\.(weight|bias|adapter\.lora_B|adapter\.lora_magnitude_vector)$"
)
_ROW_PARALLEL = re.compile(r"\.(self_attn\.o_proj|mlp\.(shared_experts\.)?down_proj)\.(weight|adapter\.lora_A)$")


def expert_split_dim(local_experts: int, expert_shard: int) -> int:
    """The dim FSDP2 splits a rank's expert stacks [E/ep, rows, cols] on over the ranks holding the same experts:
    whole experts (0) when they divide evenly, else rows (1), as torchtitan does. Dim 0 unevenly would leave
    ranks empty and others whole: the 355B layout's 5 experts per ep rank over 32 ranks put one expert on 5
    ranks and none on 27."""
    return 0 if local_experts % expert_shard == 0 else 1


def parameter_splits(name: str, layout: Layout, n_routed_experts: int) -> list[tuple[int, int]]:
    """How `layout` splits the parameter `name` (glm46.parallel.parallelize does it): (tensor dim, ways) in the
    order applied (TP, EP, then FSDP2 on the already-split tensor). Replicated mesh dims do not appear."""
    splits = []
    tp, ep = layout.tensor_parallel, layout.expert_parallel
    expert = ".experts." in name
    if tp > 1 and _COLUMN_PARALLEL.search(name):
        splits.append((0, tp))
    elif tp > 1 and _ROW_PARALLEL.search(name):
        splits.append((1, tp))
    if expert and ep > 1:
        splits.append((0, ep))
    if layout.shards_weights:
        if expert and ep > 1:  # the experts' FSDP2 groups (edp_shard)
            shard = max(1, layout.data_parallel_shard // layout.expert_parallel_dp)
            splits.append((expert_split_dim(n_routed_experts // ep, shard), shard))
        else:
            splits.append((0, layout.fsdp_shard))
    return [(dim, ways) for dim, ways in splits if ways > 1]


def largest_shard_shape(shape: tuple[int, ...], splits: list[tuple[int, int]]) -> tuple[int, ...]:
    """The shard of the first rank of every split (torch.chunk's sizes: ceil, so the largest of any rank)."""
    shape = list(shape)
    for dim, ways in splits:
        shape[dim] = -(-shape[dim] // ways)
    return tuple(shape)
