"""The plan of a composed job, before anything is spent: parameters, FLOPs, time, cost and memory per GPU.

Conventions:
- FLOPs per token are glm46.planning.counts.training_flops_per_token (6 x active matmul parameters, lm_head
  and MTP included, plus attention); the headline "6 x active x tokens" is printed beside it.
- Memory per GPU for bf16 mixed precision with fp32 master weights, on the most loaded rank: weights,
  gradients (fp32) and optimizer state (Muon: one fp32 momentum per matrix entry; AdamW: two fp32
  moments) of the shard each parameter leaves that rank (glm46.parallel.layout.parameter_splits: TP,
  then EP, then FSDP2, with torch.chunk's ceil sizes, so uneven splits count as they fall); FSDP2's
  gathered units (the root with the embedding and lm_head stays gathered through the step);
  activations are those this implementation saves for backward, per micro-batch, in bf16 (and the int64
  document ids of packed rows).
  `task=dryrun` checks the shards against the real sharded model.
- With adapters (`peft=lora|dora`, glm46.peft) the model is planned as training builds it (glm46.peft.add_adapters
  on the meta model): the frozen base in peft.base_dtype, without gradients or optimizer state; the adapters in fp32
  with their gradients and AdamW's two moments (an embedding or lm_head named in peft.targets too: it trains whole,
  in fp32), each shard as the layout splits it (per-expert adapters over EP like the
  experts, FSDP2 over its shards, each pipeline stage its layers'). FSDP2 gathers the base and the adapters and
  reduces the adapters' gradients only; activations are planned as for full training.
- Under pipeline parallelism each pipeline rank is planned on its own (`stage_memory`): the parameters of its
  stages (pipeline_parallel.split_layers), the activations of the microbatches its schedule holds in flight
  (1F1B: pp - r on rank r, so stage 0 holds pp; the interleaved and V schedules: (v - 1) pp + 2 (pp - r - 1) + 1
  chunks of one virtual stage), the microbatches' stage inputs ((1 + MTP depths) x hidden each), the logits on the
  last stage only; the most loaded rank is the plan's. One schedule runs a whole optimizer step, so its m
  microbatches are parallelism.microbatches x the step's gradient accumulation (glm46.parallel.pipeline_parallel):
  the bubble, (pp - 1) / (m + pp - 1) for 1F1B and GPipe and (pp - 1) / (v m + pp - 1) for the interleaved
  schedules (an upper bound for the zero-bubble ones), is given at the phase's smallest step (the batch-size
  warm-up's start) and its largest, and the memory at its largest.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from glm46.modules import GLM46Config
from glm46.optim.newton_schulz import workspace_bytes
from glm46.parallel.layout import PIPELINE_SCHEDULES, Layout, largest_shard_shape, parameter_splits
from glm46.parallel.pipeline_parallel import split_layers, stage_ids
from glm46.peft import AdapterSettings, is_adapter_name
from glm46.planning.counts import count_parameters, model_parameters, training_flops_per_token
from glm46.planning.peft_memory import adapter_counts, dtype_name, format_adapters

GIB = 2**30
MARGIN = 0.9  # a layout fits when the estimate stays under 90% of the device memory (allocator, NCCL buffers)


@dataclass(frozen=True)
class Hardware:
    num_nodes: int
    devices: int  # per node
    gpu_name: str
    memory_gib: float
    peak_tflops: float  # dense bf16
    mfu: float  # assumed model FLOP utilisation
    price_per_gpu_hour: float

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices


GROUPS = (
    "attention",
    "dense MLP",
    "routed experts",
    "shared experts",
    "router",
    "MTP projection",
    "embedding/lm_head",
    "norms",
)
ADAPTERS = "adapters"  # the group of PEFT's adapter tensors (glm46.peft), in the reports of a run that has them
KINDS = ("weights", "gradients", "optimizer")


def parameter_group(name: str) -> str:
    """The memory-report group of a parameter (one of GROUPS, or ADAPTERS)."""
    if is_adapter_name(name):
        return ADAPTERS
    if name.endswith("norm.weight"):
        return "norms"
    for marker, group in (
        (".experts.", "routed experts"),
        (".shared_experts.", "shared experts"),
        (".self_attn.", "attention"),
        (".mlp.gate.", "router"),
        (".mlp.", "dense MLP"),
        ("eh_proj", "MTP projection"),
    ):
        if marker in name:
            return group
    return "embedding/lm_head"


@dataclass(frozen=True)
class PlannedParameter:
    name: str
    group: str
    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]  # the largest any rank holds (glm46.parallel.layout.largest_shard_shape)
    muon: bool  # Muon (one fp32 momentum) or AdamW (two fp32 moments)
    itemsize: int = 4  # bytes per element as stored (PEFT's frozen base: peft.base_dtype's)
    trained: bool = True  # False: PEFT's frozen base, without gradients or optimizer state

    @property
    def shard_numel(self) -> int:
        return math.prod(self.shard_shape)


def planned_parameters(
    config: GLM46Config, layout: Layout, optimizer: str, peft: AdapterSettings | None = None
) -> list[PlannedParameter]:
    """Every parameter (with `peft`'s adapters, the base frozen) with the shard the layout gives the most loaded
    rank, from the model built on meta."""
    experts = config.n_routed_experts
    return [
        PlannedParameter(
            p.name,
            parameter_group(p.name),
            p.shape,
            largest_shard_shape(p.shape, parameter_splits(p.name, layout, experts)),
            optimizer == "muon" and p.muon,
            p.itemsize,
            p.trained,
        )
        for p in model_parameters(config, peft)
    ]


def state_bytes(numel: int, muon: bool, itemsize: int = 4, trained: bool = True) -> dict[str, int]:
    """Weights, gradients and optimizer state (Muon: one momentum; AdamW: two moments), each at the parameter's
    dtype (`itemsize` bytes: fp32 but for PEFT's frozen base); a frozen parameter has its weights alone."""
    moments = 1 if muon else 2
    return {
        "weights": itemsize * numel,
        "gradients": itemsize * numel if trained else 0,
        "optimizer": moments * itemsize * numel if trained else 0,
    }


def empty_state() -> dict[str, dict[str, int]]:
    """A GROUPS table of zero bytes by kind; PEFT's ADAPTERS group joins where a run holds adapters."""
    return {group: dict.fromkeys(KINDS, 0) for group in GROUPS}


def add_state(table: dict[str, dict[str, int]], group: str, nbytes: dict[str, int]) -> None:
    for kind, n in nbytes.items():
        table.setdefault(group, dict.fromkeys(KINDS, 0))[kind] += n


def state_by_group(parameters: list[PlannedParameter]) -> dict[str, dict[str, int]]:
    """Per GROUPS entry (and ADAPTERS): bytes of weights, gradients and optimizer state on the most loaded rank."""
    table = empty_state()
    for p in parameters:
        add_state(table, p.group, state_bytes(p.shard_numel, p.muon, p.itemsize, p.trained))
    return table


def state_memory(parameters: list[PlannedParameter], optimizer: str, peft: bool) -> dict[str, int]:
    """The memory table's weights, gradients and optimizer state. With adapters, the frozen base and the trained
    tensors' weights on lines of their own, each kind named by its dtype."""
    totals = {kind: sum(g[kind] for g in state_by_group(parameters).values()) for kind in KINDS}
    if not peft:
        return {f"{kind} ({'fp32' if kind != 'optimizer' else optimizer})": n for kind, n in totals.items()}
    frozen = [p for p in parameters if not p.trained]
    trained = dtype_name({p.itemsize for p in parameters if p.trained})
    base = sum(p.itemsize * p.shard_numel for p in frozen)
    return {
        f"frozen base ({dtype_name({p.itemsize for p in frozen})})": base,
        f"trained weights ({trained})": totals["weights"] - base,
        f"gradients ({trained})": totals["gradients"],
        f"optimizer ({optimizer})": totals["optimizer"],
    }


def fsdp_units(
    config: GLM46Config,
    layout: Layout,
    held: Callable[[str], bool] = lambda name: True,
    peft: AdapterSettings | None = None,
    trained_only: bool = False,
) -> dict[str, int]:
    """Elements each FSDP2 unit all-gathers (its parameters whole over the data-parallel shards, still split by
    TP and EP), as glm46.parallel.parallelize.apply_fsdp groups them: the root (embedding, final norm, lm_head;
    under pipeline parallelism a stage's part of them), each decoder layer, each MTP layer, and with expert
    parallelism each MoE layer's experts (their adapters with them) on their own. `held`: which parameters the rank
    holds, by name; `peft`: the adapters on the frozen base; `trained_only`: count only the trained parameters (the
    gradients a unit reduces)."""
    if not layout.shards_weights:
        return {}
    units: dict[str, int] = {}
    tp_and_ep_only = Layout(layout.world_size, layout.tensor_parallel, layout.expert_parallel, 1)
    for p in planned_parameters(config, tp_and_ep_only, "adamw", peft):
        if not held(p.name) or (trained_only and not p.trained):
            continue
        layer = re.match(r"^(model\.layers\.\d+|mtp_layers\.\d+)\.", p.name)
        unit = "root" if layer is None else layer[1]
        experts = re.match(r"^(.*\.experts)\.", p.name)
        if experts and layout.expert_parallel > 1:
            unit = experts[1]
        units[unit] = units.get(unit, 0) + p.shard_numel
    return units


def activation_bytes_per_token(layout: Layout, config: GLM46Config) -> dict[str, float]:
    """bf16 bytes saved for backward per token of the rank's part of the sequence (1/cp of it under context
    parallelism) on one TP rank: one MoE layer, one dense layer, and one layer's input (all that a recomputed layer
    keeps). Folded over TP, a TP rank runs the experts on 1/tp of the tokens; with sequence parallelism everything
    outside the TP regions holds 1/tp of the tokens, and the regions keep their all-gathered input; under context
    parallelism attention keeps the K and V of all cp ranks' tokens (all-gathered)."""
    tp, h, k = layout.tensor_parallel, config.hidden_size, config.num_experts_per_tok
    seq = tp if layout.sequence_parallel else 1  # the TP ranks a token's activations outside the regions split over
    gathered = h if seq > 1 else 0  # a TP region's input, all-gathered, saved by its column-parallel weights
    q = config.num_attention_heads * config.head_dim / tp
    kv = config.num_key_value_heads * config.head_dim / tp
    cp_keys = 2 * kv * layout.context_parallel if layout.context_parallel > 1 else 0  # K, V of the whole sequence
    attention = 2 * h / seq + gathered + 3 * q + 3 * kv + cp_keys  # norm in/out, q/k/v before/after RoPE, SDPA out
    fold = tp if layout.experts_fold_tp or seq > 1 else 1
    # the layer's tokens and the k expert outputs per token weighted, then expert inputs, gate/up and activation
    routed = (h + k * h) / seq + k * (h + 3 * config.moe_intermediate_size) / fold
    shared = gathered + 3 * config.moe_intermediate_size * config.n_shared_experts / tp
    moe = attention + routed + shared + 2 * config.n_routed_experts / seq  # fp32 router scores
    dense = attention + h + 3 * config.intermediate_size / tp
    # selective checkpointing keeps the matmuls' and attention's outputs: q, k, v and SDPA's output, o_proj's; the
    # router's logits; the experts' gate/up and down outputs; the shared experts' and the dense MLP's likewise
    matmuls = 2 * q + 2 * kv + h / seq
    experts = config.n_routed_experts / seq + k * (2 * config.moe_intermediate_size + h) / fold
    experts += (2 * config.moe_intermediate_size * config.n_shared_experts) / tp + h / seq
    return {
        "moe_layer": 2 * moe,
        "dense_layer": 2 * dense,
        "layer_input": 2 * h / seq,
        "moe_layer_selective": 2 * (h / seq + matmuls + experts),
        "dense_layer_selective": 2 * (h / seq + matmuls + 2 * config.intermediate_size / tp + h / seq),
    }


def stage_of(name: str, ranges: list[range], config: GLM46Config) -> int:
    """The pipeline stage holding parameter `name` (the embedding on the first, the head and MTP on the last)."""
    layer = re.match(r"^model\.layers\.(\d+)\.", name)
    if layer:
        return next(s for s, r in enumerate(ranges) if int(layer[1]) in r)
    return 0 if name.startswith("model.embed_tokens.") else len(ranges) - 1


def in_flight(layout: Layout, pp_rank: int, microbatches: int) -> tuple[int, float]:
    """(microbatch chunks pipeline rank `pp_rank` holds activations of at its peak, the share of its layers in
    each chunk) under the layout's schedule of `microbatches`."""
    pp, m, v = layout.pipeline_parallel, microbatches, layout.virtual_stages
    if PIPELINE_SCHEDULES[layout.pipeline_schedule] == 1:
        return (m if layout.pipeline_schedule == "GPipe" else min(m, pp - pp_rank)), 1.0
    return min(m * v, (v - 1) * pp + 2 * (pp - pp_rank - 1) + 1), 1.0 / v


def bubble(layout: Layout, microbatches: int) -> float:
    """The idle share of a step whose schedule runs `microbatches`: (pp - 1) / (m + pp - 1), the interleaved ones
    (pp - 1) / (v m + pp - 1)."""
    pp, m, v = layout.pipeline_parallel, microbatches, layout.virtual_stages
    return (pp - 1) / ((m if v == 1 else v * m) + pp - 1)


def stage_memory(
    config: GLM46Config,
    layout: Layout,
    micro_batch_tokens: int,
    optimizer: str,
    checkpointing: str | None,
    pp_rank: int | None,
    loss_chunk: int = 4096,
    ns_batch_bytes: int = 0,
    ns_dtype: torch.dtype = torch.float32,
    microbatches: int | None = None,
    peft: AdapterSettings | None = None,
) -> dict[str, float]:
    """Bytes on the most loaded GPU of pipeline rank `pp_rank` (None: no pipeline) by kind (see the module
    docstring), and their total; `checkpointing`: None, "full" or "selective" (glm46.parallel.checkpointing);
    `micro_batch_tokens` are one (pipeline) micro-batch's, `microbatches` those of one schedule (a step's; None:
    parallelism.microbatches, a step without accumulation); `peft`: the adapters trained on the frozen base."""
    parameters = planned_parameters(config, layout, optimizer, peft)
    dense_layers, moe_layers = config.first_k_dense_replace, config.num_hidden_layers - config.first_k_dense_replace
    mtp, chunks, share, stage_inputs = config.num_nextn_predict_layers, 1, 1.0, 0
    head = True
    if pp_rank is not None:
        ranges = split_layers(config, layout.num_stages, layout.layers_per_stage)
        mine = set(stage_ids(layout, pp_rank))
        parameters = [p for p in parameters if stage_of(p.name, ranges, config) in mine]
        held = [i for s in mine for i in ranges[s]]
        dense_layers = sum(i < config.first_k_dense_replace for i in held)
        moe_layers = len(held) - dense_layers
        head = layout.num_stages - 1 in mine
        mtp = mtp if head else 0
        chunks, share = in_flight(layout, pp_rank, microbatches or layout.microbatches)
        stage_inputs = chunks * micro_batch_tokens * 2 * config.hidden_size * (1 + config.num_nextn_predict_layers)
    act = activation_bytes_per_token(layout, config)
    layers = dense_layers + moe_layers + mtp
    full = (moe_layers + mtp) * act["moe_layer"] + dense_layers * act["dense_layer"]
    recomputed = max(act["moe_layer"], act["dense_layer"])  # one layer at a time, in backward
    if checkpointing == "full":  # each layer keeps its input
        full = chunks * layers * act["layer_input"] * share + recomputed
    elif checkpointing == "selective":  # and its matmuls' and attention's outputs
        kept = (moe_layers + mtp) * act["moe_layer_selective"] + dense_layers * act["dense_layer_selective"]
        full = chunks * kept * share + recomputed
    else:
        full = chunks * full * share
    local_tokens = micro_batch_tokens // (layout.tensor_parallel if layout.sequence_parallel else 1)
    local_tokens //= layout.context_parallel
    logits = min(local_tokens, loss_chunk) * config.vocab_size * (2 + 4 + 4) if head else 0  # bf16, fp32 x 2
    # What is left of the document mask of packed rows: one int64 document number per token (Documents.ids),
    # kept through the step; per-document attention needs no [T, T] mask (glm46.modules.attention).
    documents = 8 * micro_batch_tokens * chunks
    memory = state_memory(parameters, optimizer, peft is not None)
    memory["activations"] = full * micro_batch_tokens / layout.context_parallel + logits + documents + stage_inputs
    held = (lambda name: True) if pp_rank is None else (lambda name: stage_of(name, ranges, config) in mine)
    units = fsdp_units(config, layout, held, peft)
    trained = fsdp_units(config, layout, held, peft, trained_only=True) if peft is not None else None
    memory.update(gathered_bytes(units, layout.reshards_after_forward, trained))
    if optimizer == "muon":  # held in the optimizer step, when activations are freed: counted on top, an upper bound
        muon_bytes = sum(4 * p.shard_numel for p in parameters if p.muon)  # about what the rank orthogonalises
        memory["Newton-Schulz workspace"] = workspace_bytes(min(ns_batch_bytes, muon_bytes), ns_dtype)
    memory["total"] = sum(memory.values())
    return memory


def gathered_bytes(
    units: dict[str, int], reshard_after_forward: bool, gradients: dict[str, int] | None = None
) -> dict[str, float]:
    """FSDP2's unsharded copies (bf16): the root unit stays gathered through the step (reshard_after_forward off
    for it), and one more unit at a time besides it, or, without resharding, every unit from its forward to its
    backward; and the largest unit's gradient before its fp32 reduce-scatter. `gradients`: the elements of each
    unit that have gradients (PEFT's trained ones; None: all of them)."""
    if not units:
        return {"gathered (FSDP2)": 0, "unsharded gradient (FSDP2)": 0}
    layers = [n for unit, n in units.items() if unit != "root"]
    held = max(layers, default=0) if reshard_after_forward else sum(layers)
    gradients = units if gradients is None else gradients
    reduced = [n for unit, n in gradients.items() if unit != "root"]
    return {
        "gathered (FSDP2)": 2 * (units.get("root", 0) + held),
        "unsharded gradient (FSDP2)": 4 * max(gradients.get("root", 0), max(reduced, default=0)),
    }


def si(value: float, unit: str) -> str:
    """4.45e24 FLOPs -> '4.45e24 FLOPs (4.45 yotta)'; the prefix is where the seeds' arithmetic went wrong."""
    for exponent, prefix in ((24, "yotta"), (21, "zetta"), (18, "exa"), (15, "peta"), (12, "tera"), (9, "giga")):
        if value >= 10**exponent:
            return f"{value:.4g} {unit} ({value / 10**exponent:.4g} {prefix}{unit})"
    return f"{value:.4g} {unit}"


def plan(
    config: GLM46Config,
    layout: Layout,
    hardware: Hardware,
    tokens: float,
    seq_len: int,
    micro_batch: int,
    optimizer: str,
    checkpointing: str | None,
    ns_batch_bytes: int = 0,
    ns_dtype: torch.dtype = torch.float32,
    accumulation: tuple[int, int] = (1, 1),
    peft: AdapterSettings | None = None,
) -> dict:
    """accumulation: the phase's gradient accumulation at its smallest step (the batch-size warm-up's start) and
    its largest: a pipeline's schedule runs parallelism.microbatches times it. peft: the adapters trained on the
    frozen base (None: full training)."""
    counts = count_parameters(config)
    flops_per_token = training_flops_per_token(config, seq_len)
    total_flops = flops_per_token * tokens
    cluster_flops = hardware.world_size * hardware.peak_tflops * 1e12 * hardware.mfu
    gpu_hours = total_flops / (hardware.peak_tflops * 1e12 * hardware.mfu) / 3600
    pipelined = layout.pipeline_parallel > 1
    tokens_per_micro = micro_batch // (layout.microbatches if pipelined else 1) * seq_len
    schedules = [layout.microbatches * a for a in accumulation]  # microbatches per schedule, smallest and largest
    by_rank = [  # bytes on each pipeline rank (one entry, the whole model, without pipeline parallelism)
        stage_memory(
            config,
            layout,
            tokens_per_micro,
            optimizer,
            checkpointing,
            r if pipelined else None,
            ns_batch_bytes=ns_batch_bytes,
            ns_dtype=ns_dtype,
            microbatches=max(schedules),
            peft=peft,
        )
        for r in range(layout.pipeline_parallel)
    ]
    loaded = max(range(len(by_rank)), key=lambda r: by_rank[r]["total"])
    memory = by_rank[loaded]  # the most loaded rank's
    activations = {  # that rank's activations under each choice of activation checkpointing
        str(mode).lower(): stage_memory(
            config,
            layout,
            tokens_per_micro,
            optimizer,
            mode,
            loaded if pipelined else None,
            microbatches=max(schedules),
            peft=peft,
        )["activations"]
        for mode in (None, "selective", "full")
    }
    ends = sorted({0, layout.pipeline_parallel // 2, layout.pipeline_parallel - 1}) if pipelined else []
    stages = {r: by_rank[r] for r in ends}  # the first, a middle and the last pipeline rank, for the table
    capacity = hardware.memory_gib * GIB * MARGIN
    notes = []
    if memory["total"] > capacity:
        floor = memory["activations"] + memory["gathered (FSDP2)"] + memory["unsharded gradient (FSDP2)"]
        if floor > capacity:
            held = (
                "hold fewer microbatches in flight (the pipeline stages keep several; 128K rows run without stages: "
                "parallelism=long_context, experiment=midtrain_long)"
                if pipelined
                else "add pipeline stages"
            )
            fix = (
                f"even fully sharded, one micro-batch's activations need {floor / GIB:.1f} GiB: split the sequence "
                f"more (parallelism.sequence_parallel with TP, parallelism.context_parallel) or {held}"
                + {
                    None: "; or turn on parallelism.activation_checkpointing",
                    "selective": "; or parallelism.activation_checkpointing_mode=full",
                }.get(checkpointing, "")
            )
        else:
            fix = "shard more (data_parallel_shard=-1, expert_parallel) or turn on activation checkpointing"
        notes.append(
            f"does not fit: {memory['total'] / GIB:.1f} GiB per GPU > {MARGIN:.0%} of "
            f"{hardware.memory_gib:g} GiB; {fix}"
        )
    result = {
        "parameters": counts,
        "flops_per_token": flops_per_token,
        "six_n_flops": 6 * counts["active"] * tokens,
        "total_flops": total_flops,
        "tokens": tokens,
        "tokens_per_second": cluster_flops / flops_per_token,
        "gpu_hours": gpu_hours,
        "days": gpu_hours / hardware.world_size / 24,
        "cost": gpu_hours * hardware.price_per_gpu_hour,
        "memory": memory,
        "activations_by_checkpointing": activations,
        "stages": stages,
        "by_pipeline_rank": by_rank,
        "schedule_microbatches": schedules,
        "bubble_range": [bubble(layout, m) if pipelined else 0.0 for m in schedules],  # smallest step, largest
        "fits": memory["total"] <= capacity,
        "notes": notes,
    }
    if peft is not None:
        result["peft"] = adapter_counts(config, peft)
    return result


def format_range(values: list, form: str) -> str:
    """'64 -> 256' for the smallest and largest step, one value where they are the same."""
    first, last = (form.format(v) for v in values)
    return first if first == last else f"{first} -> {last}"


def format_plan(result: dict, hardware: Hardware, layout: Layout) -> str:
    counts = result["parameters"]
    lines = [
        f"parameters: total {counts['total']:,}, active per token {counts['active']:,}",
        *([format_adapters(result["peft"])] if "peft" in result else []),
        f"FLOPs per token (6 x active + lm_head/MTP + attention): {result['flops_per_token']:.4g}",
        f"tokens: {result['tokens']:.4g}",
        f"training FLOPs: {si(result['total_flops'], 'FLOPs')}; 6 x active x tokens alone: "
        f"{si(result['six_n_flops'], 'FLOPs')}",
        f"cluster: {hardware.num_nodes} nodes x {hardware.devices} {hardware.gpu_name} = {hardware.world_size} GPUs "
        f"at {hardware.peak_tflops:g} TFLOP/s bf16 and an assumed MFU of {hardware.mfu:.0%}",
        f"throughput: {result['tokens_per_second']:,.0f} tokens/s; {result['gpu_hours']:,.0f} GPU-hours = "
        f"{result['days']:,.1f} days; cost {result['cost']:,.0f} at {hardware.price_per_gpu_hour:g} per GPU-hour",
        f"layout: world {layout.world_size} = tp {layout.tensor_parallel} x pp {layout.pipeline_parallel} x "
        + (f"cp {layout.context_parallel} x " if layout.context_parallel > 1 else "")
        + f"dp {layout.data_parallel} (ep {layout.expert_parallel}, FSDP shard {layout.fsdp_shard}"
        + (f" = dp shard {layout.data_parallel_shard} x cp" if layout.context_parallel > 1 else "")
        + ")"
        + (", sequence parallel over tp" if layout.sequence_parallel else ""),
    ]
    if result["stages"]:
        lines.append(
            f"pipeline: {layout.num_stages} stages ({layout.pipeline_schedule}, {layout.virtual_stages} per rank), "
            f"{format_range(result['schedule_microbatches'], '{}')} microbatches per step "
            f"({layout.microbatches} per batch x the step's accumulation), bubble "
            f"{format_range(result['bubble_range'], '{:.1%}')}; GiB per GPU by pipeline rank:"
        )
        kinds = list(next(iter(result["stages"].values())))
        lines.append(f"  {'':28s} " + " ".join(f"{'rank ' + str(r):>9s}" for r in result["stages"]))
        lines += [
            f"  {kind:28s} " + " ".join(f"{memory[kind] / GIB:9.2f}" for memory in result["stages"].values())
            for kind in kinds
        ]
    lines.append("memory per GPU" + (" (the most loaded pipeline rank):" if result["stages"] else ":"))
    lines += [f"  {name:28s} {value / GIB:9.2f} GiB" for name, value in result["memory"].items()]
    lines.append(f"  fits {hardware.memory_gib:g} GiB (with a 10% margin): {'yes' if result['fits'] else 'NO'}")
    choices = ", ".join(f"{mode} {value / GIB:.2f}" for mode, value in result["activations_by_checkpointing"].items())
    lines.append(f"  activations (GiB) by parallelism.activation_checkpointing[_mode]: {choices}")
    lines += [f"note: {note}" for note in result["notes"]]
    return "\n".join(lines)
