"""`task=dryrun`: the composed job at its real world size, as one of its ranks, in one CPU process.

torch's fake process group stands in for the world (`init_process_group("fake")`: collectives return
copies, so nothing numeric is checked here), and everything else is the real code: the device mesh of
the layout, the model built on the meta device (with `peft`, its adapters on the frozen base, as training adds them:
glm46.peft.add_adapters), glm46.parallel.parallelize (TP, EP, activation checkpointing, FSDP2) and the optimizer
built on the resulting shards. Nothing is allocated: the bytes come from each parameter's local shard shape and
dtype (a frozen base parameter has no gradient or optimizer state). The report sets them, by parameter group, beside
`task=plan`'s figures for the most loaded rank, names the largest tensor any rank gathers, and fails
naming the parameter when a shard is larger than the plan says (a tensor left replicated), or when
the rank's total does not fit the GPU. Anchors: Megatron-LM's `--fake-process-group`, torchtitan's
`comm.mode=fake_backend`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor

from glm46.errors import ConfigError
from glm46.modules import GLM46Config, GLM46ForCausalLM
from glm46.optim import Muon, muon_param_groups
from glm46.optim.distributed_muon import splits_matrices
from glm46.parallel.checkpointing import checkpointing_mode
from glm46.parallel.layout import MESH_DIMS, Layout
from glm46.parallel.mesh import build_mesh
from glm46.parallel.parallelize import fsdp_policy, parallelize
from glm46.parallel.pipeline_parallel import split_layers, split_model, stage_ids
from glm46.peft import AdapterSettings, add_adapters
from glm46.peft.settings import peft_settings
from glm46.planning.plan import (
    GIB,
    MARGIN,
    Hardware,
    add_state,
    empty_state,
    parameter_group,
    planned_parameters,
    stage_of,
    state_by_group,
    state_bytes,
)

# The plan's memory beside the state a dry run measures itself: transient buffers, a colocated rollout engine's share
TRANSIENT = ("activations", "gathered", "unsharded", "Newton-Schulz", "rollout")
SPLIT_BEFORE_FSDP = ("tp", "ep")  # mesh dims that split a tensor before FSDP2; its all-gather leaves them split


@dataclass
class DryRun:
    rank: int
    coordinate: list[int]
    state: dict[str, dict[str, int]]  # group -> weights/gradients/optimizer bytes of this rank's shards
    planned: dict[str, dict[str, int]]  # the plan's, for the most loaded rank
    largest_gather: tuple[str, int]  # (what, bytes): the largest tensor any rank gathers whole
    problems: list[str]
    seconds: float


def fake_world(rank: int, world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise ConfigError(f"dryrun.rank={rank} must be in [0, world size {world_size})")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


class LazyChunks(Sequence):
    """torch.chunk(tensor, num_chunks, dim) padded with empty tensors to `num_chunks`, as FSDP2's
    `_chunk_with_empty` gives it, each chunk made when asked for: FSDP2 reads two of them (its rank's and the first),
    and at the seeds' 8,192 ranks making all of them is most of a dry run (5 ms a parameter, 3,155 parameters)."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int):
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim
        self.rows = tensor.size(dim)
        self.step = -(-self.rows // num_chunks)  # torch.chunk's chunk size

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.num_chunks))]
        if not -self.num_chunks <= index < self.num_chunks:
            raise IndexError(index)
        start = (index % self.num_chunks) * self.step
        if self.rows == 0:  # torch.chunk of an empty dim: num_chunks empty views of the tensor
            return self.tensor.narrow(self.dim, 0, 0)
        if start >= self.rows:
            return self.tensor.new_empty(0)
        return self.tensor.narrow(self.dim, start, min(self.step, self.rows - start))


@contextlib.contextmanager
def lazy_chunks() -> Iterator[None]:
    """FSDP2 chunks every parameter over the ranks sharing it (torch/distributed/fsdp/_fully_shard/_fsdp_common.py:
    `_chunk_with_empty`, torch.chunk padded with one new empty tensor per missing chunk), then reads only its own
    rank's chunk and the first. At the seeds' 8,192 ranks the RL layout (FSDP2 over every rank) would make 15 million
    tensors: minutes of one CPU. While the dry run shards, the chunks are made when read. A torch without that
    function shards unchanged."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    original = getattr(_fsdp_param, "_chunk_with_empty", None)
    if original is None:
        yield
        return
    _fsdp_param._chunk_with_empty = LazyChunks
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original


def optimizer_groups(model: GLM46ForCausalLM, peft: AdapterSettings | None) -> list[dict]:
    """The optimizer's parameter groups, as GLM46LitModule.param_groups makes them: Muon's and AdamW's, or with
    adapters the trained tensors alone in AdamW's group at peft.lr."""
    if peft is None:
        return muon_param_groups(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    return [{"params": trained, "use_muon": False, "lr": peft.lr, "weight_decay": peft.weight_decay}]


def gathered_numel(p: DTensor) -> int:
    """Elements of p that FSDP2 all-gathers: whole over the data-parallel dims, still split by TP and EP."""
    numel = p.numel()
    for name, placement in zip(p.device_mesh.mesh_dim_names, p.placements):
        if placement.is_shard() and name in SPLIT_BEFORE_FSDP:
            numel //= p.device_mesh[name].size()
    return numel


def largest_gather(model: GLM46ForCausalLM, optimizer: torch.optim.Optimizer) -> tuple[str, int]:
    """The largest tensor a rank holds whole at once: an FSDP2 all-gather (bf16) or a Muon Newton-Schulz input
    (fp32; whole matrices, experts split only on the expert dim)."""
    muon = {id(p) for group in optimizer.param_groups if group.get("use_muon") for p in group["params"]}
    best = ("nothing", 0)
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        candidates = [(f"{name} (FSDP2 all-gather, bf16)", 2 * gathered_numel(p))]
        if id(p) in muon:
            whole = math.prod(p.shape)
            for mesh_name, placement in zip(p.device_mesh.mesh_dim_names, p.placements):
                if placement.is_shard() and not splits_matrices(placement, p.ndim):  # what Muon keeps split
                    whole //= p.device_mesh[mesh_name].size()
            candidates.append((f"{name} (Muon Newton-Schulz, fp32)", 4 * whole))
        best = max([best, *candidates], key=lambda c: c[1])
    return best


def dry_run(cfg: DictConfig, config: GLM46Config, hardware: Hardware, layout: Layout) -> DryRun:
    started = time.time()
    rank = int(cfg.get("dryrun", {}).get("rank", 0))
    peft = peft_settings(cfg)
    fake_world(rank, layout.world_size)
    try:
        mesh = build_mesh(layout, "cpu")
        with torch.device("meta"):
            model = GLM46ForCausalLM(config)
        if peft is not None:
            add_adapters(model, peft)
        stages = None
        if layout.pipeline_parallel > 1:  # this rank's stages only, as MeshParallelStrategy.parallelize splits them
            pp_rank = mesh["pp"].get_local_rank()
            stages = split_model(model, layout, pp_rank)
        parallelism = cfg.parallelism
        policy = fsdp_policy(cfg.trainer.precision, OmegaConf.to_container(parallelism.mixed_precision))
        with lazy_chunks():
            recompute = checkpointing_mode(
                parallelism.activation_checkpointing, parallelism.activation_checkpointing_mode
            )
            parallelize(model, layout, mesh, recompute, policy, stages)
        optimizer = instantiate(cfg.optim.optimizer)(optimizer_groups(model, peft))  # built on the meta shards
        muon = isinstance(optimizer, Muon)  # AdamW ignores the groups' use_muon: two moments for every parameter
        uses_muon = {id(p): muon and bool(g.get("use_muon")) for g in optimizer.param_groups for p in g["params"]}
        kind = "muon" if any(uses_muon.values()) else "adamw"
        planned = {p.name: p for p in planned_parameters(config, layout, kind, peft)}
        if stages is not None:  # the plan of this pipeline rank's stages
            ranges = split_layers(config, layout.num_stages, layout.layers_per_stage)
            mine = stage_ids(layout, mesh["pp"].get_local_rank())
            planned = {n: p for n, p in planned.items() if stage_of(n, ranges, config) in mine}
        state = empty_state()
        problems = []
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            trained = id(p) in uses_muon  # what the optimizer holds: every parameter, or PEFT's trained ones
            nbytes = state_bytes(local.numel(), uses_muon.get(id(p), False), local.element_size(), trained)
            add_state(state, parameter_group(name), nbytes)
            plan = planned[name]
            if local.numel() > plan.shard_numel:
                how = "is replicated" if local.numel() == p.numel() else "is split less than planned"
                problems.append(
                    f"{name} {how}: this rank holds {tuple(local.shape)} of {tuple(p.shape)}, the plan "
                    f"gives at most {plan.shard_shape} to a rank"
                )
        coordinate = mesh.get_coordinate()
        return DryRun(
            rank,
            coordinate,
            state,
            state_by_group(planned.values()),
            largest_gather(model, optimizer),
            problems,
            time.time() - started,
        )
    finally:
        dist.destroy_process_group()


def format_dry_run(run: DryRun, memory: dict[str, float], hardware: Hardware, layout: Layout) -> str:
    """The per-group table (this rank's shards beside the plan's most loaded rank) and the verdict."""
    dims = dict(zip(MESH_DIMS, run.coordinate))
    lines = [
        f"dry run: rank {run.rank} of {layout.world_size} (fake process group), mesh coordinate "
        + ", ".join(f"{k}={v}" for k, v in dims.items())
        + f"; built, sharded and optimizer set up in "
        f"{run.seconds:.1f} s",
        f"{'GiB per GPU':18s} "
        + " ".join(f"{k:>9s}" for k in ("weights", "grads", "optim"))
        + " | "
        + " ".join(f"{'plan':>9s}" for _ in range(3)),
    ]
    for group, plan in run.planned.items():
        mine = run.state.get(group, dict.fromkeys(plan, 0))
        lines.append(
            f"{group:18s} "
            + " ".join(f"{mine[k] / GIB:9.3f}" for k in mine)
            + " | "
            + " ".join(f"{plan[k] / GIB:9.3f}" for k in plan)
        )
    total = {k: sum(g[k] for g in run.state.values()) for k in ("weights", "gradients", "optimizer")}
    planned_total = {k: sum(g[k] for g in run.planned.values()) for k in total}
    lines.append(
        f"{'total':18s} "
        + " ".join(f"{v / GIB:9.3f}" for v in total.values())
        + " | "
        + " ".join(f"{v / GIB:9.3f}" for v in planned_total.values())
    )
    others = {k: v for k, v in memory.items() if k.startswith(TRANSIENT)}
    rank_total = sum(total.values()) + sum(others.values())
    lines += [f"{name} (plan): {value / GIB:.2f} GiB" for name, value in others.items()]
    what, nbytes = run.largest_gather
    lines.append(f"largest tensor gathered whole on a rank: {what}: {nbytes / GIB:.3f} GiB")
    fits = rank_total <= hardware.memory_gib * GIB * MARGIN
    lines.append(
        f"rank total: {rank_total / GIB:.2f} GiB of {hardware.memory_gib:g} GiB "
        f"({MARGIN:.0%} usable: {'fits' if fits else 'DOES NOT FIT'})"
    )
    return "\n".join(lines)


def check(run: DryRun, memory: dict[str, float], hardware: Hardware) -> None:
    """Raise ConfigError naming the parameters left larger than planned, or the memory that does not fit."""
    if run.problems:
        raise ConfigError(
            f"dry run, rank {run.rank}: {len(run.problems)} parameter(s) not sharded as planned:\n  "
            + "\n  ".join(run.problems[:20])
        )
    others = sum(v for k, v in memory.items() if k.startswith(TRANSIENT))
    total = sum(sum(g.values()) for g in run.state.values()) + others
    if total > hardware.memory_gib * GIB * MARGIN:
        raise ConfigError(
            f"dry run, rank {run.rank}: {total / GIB:.1f} GiB does not fit {MARGIN:.0%} of "
            f"{hardware.memory_gib:g} GiB (cluster.gpu.memory_gib)"
        )
