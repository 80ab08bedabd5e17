"""A parallel layout: how `world_size` processes split into data, expert and tensor parallel groups.

Sizes (the `parallelism` config group's keys):
- `tensor_parallel` (tp): attention heads, KV heads and dense/shared MLPs split over tp ranks
  (Megatron column/row parallel through torch's `parallelize_module`);
- data parallelism takes the rest: dp = world_size / tp ranks see different batches;
  `data_parallel_shard` of them shard parameters, gradients and optimizer state (FSDP2), and the
  dp / data_parallel_shard shard groups replicate each other (HSDP; 1 = replicate only, DDP-like);
- `expert_parallel` (ep) is carved out of the data-parallel ranks (ep divides dp): the routed
  experts are split over ep ranks, which exchange tokens all-to-all; every ep rank still sees its
  own batch, so the experts' data-parallel degree is dp / ep;
- `pipeline_parallel` must be 1: Lightning offers no pipeline parallelism.

`Layout.from_config` checks the layout's own rules (sizes, world size, what each engine can split);
`model_problems` the model against it (glm46.app.checks runs both before anything is queued).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any

from glm46.errors import ConfigError
from glm46.modules.config import GLM46Config

ENGINES = ("single", "ddp", "mesh", "deepspeed")
MESH_DIMS = ("edp_replicate", "ep_replicate", "edp_shard", "ep_shard", "tp")
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Layout:
    """The one object that says how a job is laid out, as torchtitan's ParallelDims: built once from the typed
    `parallelism` node (`Layout.from_config`) and handed to the strategy, the plan, the dry run and the checks."""

    world_size: int
    tensor_parallel: int = 1
    expert_parallel: int = 1
    data_parallel_shard: int = 1  # resolved: a divisor of data_parallel (never -1)
    pipeline_parallel: int = 1
    engine: str = "mesh"

    @classmethod
    def from_config(cls, parallelism: Any, world_size: int) -> Layout:
        """The layout of a `parallelism` node (schema glm46.app.schema.launch.ParallelismConfig) on `world_size`
        processes; ConfigError naming the keys and values when the sizes cannot run together."""
        problems = layout_problems(parallelism, world_size)
        if problems:
            raise ConfigError(f"parallelism={parallelism.name}: " + "; ".join(problems))
        shard = parallelism.data_parallel_shard
        dp = world_size // parallelism.tensor_parallel
        return cls(
            world_size,
            parallelism.tensor_parallel,
            parallelism.expert_parallel,
            dp if shard == -1 else shard,
            parallelism.pipeline_parallel,
            parallelism.engine,
        )

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.tensor_parallel

    @property
    def data_parallel_replicate(self) -> int:
        return self.data_parallel // self.data_parallel_shard

    @property
    def expert_data_parallel(self) -> int:
        """Ranks holding the same experts (they average the experts' gradients)."""
        return self.data_parallel // self.expert_parallel

    @property
    def mesh_shape(self) -> tuple[int, int, int, int, int]:
        """Sizes of MESH_DIMS. The data-parallel ranks are (replicate x shard); ep takes the innermost
        ep of them: from inside the shard groups when ep divides data_parallel_shard, otherwise all
        of each shard group and ep / data_parallel_shard shard groups."""
        shard, replicate, ep = self.data_parallel_shard, self.data_parallel_replicate, self.expert_parallel
        if shard % ep == 0:
            return (replicate, 1, shard // ep, ep, self.tensor_parallel)
        outer = ep // shard
        return (replicate // outer, outer, 1, shard, self.tensor_parallel)


def is_muon(target: str) -> bool:
    """Whether the optimizer `_target_` names glm46's Muon (or a subclass); False when it cannot be imported."""
    from glm46.optim import Muon

    module, _, name = target.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name, None) if module else None
    except ImportError:
        return False
    return isinstance(found, type) and issubclass(found, Muon)


def layout_problems(parallelism: Any, world_size: int) -> list[str]:
    """What keeps the sizes and switches of a `parallelism` node from running on `world_size` processes (empty:
    nothing). Checked in order, each group of rules only once the one before it holds."""
    engine, tp, ep = parallelism.engine, parallelism.tensor_parallel, parallelism.expert_parallel
    pp, shard = parallelism.pipeline_parallel, parallelism.data_parallel_shard
    basics = [
        (engine in ENGINES, f"parallelism.engine={engine!r} is not one of {list(ENGINES)}"),
        *(
            (value >= 1, f"parallelism.{key}={value!r} must be an integer >= 1")
            for key, value in (("tensor_parallel", tp), ("expert_parallel", ep), ("pipeline_parallel", pp))
        ),
        (
            shard >= 1 or shard == -1,
            f"parallelism.data_parallel_shard={shard!r} must be an integer >= 1, or -1 for all data-parallel ranks",
        ),
        (world_size >= 1, f"world size {world_size!r} must be an integer >= 1"),
    ]
    engines = [
        (
            pp == 1,
            f"parallelism.pipeline_parallel={pp}: Lightning offers no pipeline parallelism (no strategy "
            f"splits layers into stages), so only 1 runs; spread the model with tensor_parallel, "
            f"expert_parallel and data_parallel_shard (FSDP2) instead",
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
            not parallelism.activation_checkpointing or engine == "mesh",
            f"parallelism.activation_checkpointing=true is applied by engine=mesh (fsdp2, ep, tp, ...), not {engine}",
        ),
        (
            engine != "single" or world_size == 1,
            f"parallelism=single runs one process, but the cluster has world size {world_size} "
            f"(cluster.num_nodes x cluster.devices): choose ddp, fsdp2, ... or devices=1",
        ),
    ]
    for rules in (basics, engines):
        problems = [message for ok, message in rules if not ok]
        if problems:
            return problems
    if world_size % tp:
        return [
            f"world size {world_size} (cluster.num_nodes x cluster.devices) must be divisible by "
            f"parallelism.tensor_parallel={tp}"
        ]
    dp = world_size // tp
    resolved = dp if shard == -1 else shard
    sizes = [
        (
            dp % ep == 0,
            f"world size {world_size} must be divisible by tensor_parallel x expert_parallel = {tp} x {ep} = "
            f"{tp * ep} (experts are split over ep of the {dp} data-parallel ranks)",
        ),
        (
            engine != "mesh" or dp % resolved == 0,
            f"parallelism.data_parallel_shard={shard} must divide the data-parallel size world size / "
            f"tensor_parallel = {world_size} / {tp} = {dp}",
        ),
        (
            engine != "mesh" or dp % resolved or dp % ep or resolved % ep == 0 or ep % resolved == 0,
            f"parallelism.expert_parallel={ep} and data_parallel_shard={resolved} must divide one another "
            f"(ep groups lie inside a shard group, or span whole shard groups)",
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


def model_problems(layout: Layout, model: GLM46Config) -> list[str]:
    """What keeps `model` from being split by `layout`: heads, widths and experts against the tensor and expert
    parallel sizes."""
    tp, ep = layout.tensor_parallel, layout.expert_parallel
    shared = model.moe_intermediate_size * model.n_shared_experts
    has_moe = model.first_k_dense_replace < model.num_hidden_layers or model.num_nextn_predict_layers > 0
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
        (ep == 1 or has_moe, f"parallelism.expert_parallel={ep} but the model has no MoE layer"),
    ]
    return [message for ok, message in rules if not ok]


# ---------------------------------------------------------------- what each parameter is split by

_COLUMN_PARALLEL = re.compile(
    r"\.(self_attn\.[qkv]_proj\.(weight|bias)|mlp\.(shared_experts\.)?(gate|up)_proj\.weight)$"
)
_ROW_PARALLEL = re.compile(r"\.(self_attn\.o_proj|mlp\.(shared_experts\.)?down_proj)\.weight$")


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
    if layout.data_parallel > 1:
        if expert and ep > 1:
            shard = max(1, layout.data_parallel_shard // ep)  # the expert-data-parallel ranks' shard groups
            splits.append((expert_split_dim(n_routed_experts // ep, shard), shard))
        else:
            splits.append((0, layout.data_parallel_shard))
    return [(dim, ways) for dim, ways in splits if ways > 1]


def largest_shard_shape(shape: tuple[int, ...], splits: list[tuple[int, int]]) -> tuple[int, ...]:
    """The shard of the first rank of every split (torch.chunk's sizes: ceil, so the largest of any rank)."""
    shape = list(shape)
    for dim, ways in splits:
        shape[dim] = -(-shape[dim] // ways)
    return tuple(shape)
