"""The plan of a composed job, before anything is spent: parameters, FLOPs, time, cost and memory per GPU.

Conventions:
- FLOPs per token are glm46.estimate.training_flops_per_token (6 x active matmul parameters, lm_head
  and MTP included, plus attention); the headline "6 x active x tokens" is printed beside it.
- Memory per GPU for bf16 mixed precision with fp32 master weights: weights, gradients (fp32) and
  optimizer state (Muon: one fp32 momentum per matrix entry; AdamW: two fp32 moments) are divided
  by the ranks that shard them (TP for attention and dense MLPs, EP then the expert-data-parallel
  shard for routed experts, FSDP2 `data_parallel_shard` for everything); activations are those
  this implementation saves for backward, per micro-batch, in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm46.estimate import count_parameters, training_flops_per_token
from glm46.modules import GLM46Config, GLM46ForCausalLM
from glm46.optim import muon_param_groups
from glm46.parallel.layout import Layout

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


def parameter_split(config: GLM46Config) -> dict[str, int]:
    """Parameters by how they are sharded (routed experts over EP; attention, dense and shared MLP
    matrices over TP; the rest: embedding, lm_head, norms, routers, biases) and how many Muon updates
    (glm46.optim.muon_param_groups' rule), from the model built on the meta device."""
    with torch.device("meta"):
        model = GLM46ForCausalLM(config)
    split = {"routed": 0, "tensor_parallel": 0, "rest": 0}
    for name, p in model.named_parameters():
        if ".experts." in name:
            split["routed"] += p.numel()
        elif p.ndim == 2 and any(f".{part}." in name for part in ("self_attn", "shared_experts")) or (
                p.ndim == 2 and ".mlp." in name and ".gate." not in name):
            split["tensor_parallel"] += p.numel()
        else:
            split["rest"] += p.numel()
    split["total"] = sum(split.values())
    split["muon"] = sum(p.numel() for group in muon_param_groups(model) if group["use_muon"] for p in group["params"])
    return split


def activation_bytes_per_token(config: GLM46Config, tensor_parallel: int) -> dict[str, float]:
    """bf16 bytes saved for backward per token: one MoE layer, one dense layer, and one layer's input
    (all that a recomputed layer keeps)."""
    h, k = config.hidden_size, config.num_experts_per_tok
    q = config.num_attention_heads * config.head_dim / tensor_parallel
    kv = config.num_key_value_heads * config.head_dim / tensor_parallel
    attention = 2 * h + 3 * q + 3 * kv  # norm input/output, q/k/v before and after RoPE, SDPA output
    routed = h + k * (2 * h + 3 * config.moe_intermediate_size)  # gathered tokens, gate/up, act, down
    shared = 3 * config.moe_intermediate_size * config.n_shared_experts / tensor_parallel
    moe = attention + routed + shared + 2 * config.n_routed_experts  # fp32 router scores
    dense = attention + h + 3 * config.intermediate_size / tensor_parallel
    return {"moe_layer": 2 * moe, "dense_layer": 2 * dense, "layer_input": 2 * h}


def memory_per_gpu(config: GLM46Config, layout: Layout, micro_batch_tokens: int, optimizer: str,
                   activation_checkpointing: bool, loss_chunk: int = 4096) -> dict[str, float]:
    """Bytes per GPU by kind (see the module docstring), and their total."""
    split = parameter_split(config)
    shard = layout.data_parallel_shard
    expert_shard = max(1, shard // layout.expert_parallel) if shard >= layout.expert_parallel else 1
    per_gpu = (split["routed"] / (layout.expert_parallel * expert_shard)
               + split["tensor_parallel"] / (layout.tensor_parallel * shard) + split["rest"] / shard)
    muon_fraction = split["muon"] / split["total"] if optimizer == "muon" else 0.0
    optimizer_bytes = per_gpu * (4 * muon_fraction + 8 * (1 - muon_fraction))
    act = activation_bytes_per_token(config, layout.tensor_parallel)
    layers = config.num_hidden_layers + config.num_nextn_predict_layers
    moe_layers = layers - config.first_k_dense_replace
    full = moe_layers * act["moe_layer"] + config.first_k_dense_replace * act["dense_layer"]
    if activation_checkpointing:  # each layer keeps its input; one layer at a time is recomputed
        full = layers * act["layer_input"] + max(act["moe_layer"], act["dense_layer"])
    logits = min(micro_batch_tokens, loss_chunk) * config.vocab_size * (2 + 4 + 4)  # bf16 logits, fp32 softmax + grad
    # FSDP2 gathers one layer's bf16 weights (and its gradient) at a time.
    gathered = 4 * (split["total"] - split["rest"]) / layers / layout.tensor_parallel if shard > 1 else 0
    memory = {
        "weights (fp32)": 4 * per_gpu,
        "gradients (fp32)": 4 * per_gpu,
        f"optimizer ({optimizer})": optimizer_bytes,
        "activations": full * micro_batch_tokens + logits,
        "gathered layer (FSDP2)": gathered,
    }
    memory["total"] = sum(memory.values())
    return memory


def si(value: float, unit: str) -> str:
    """4.45e24 FLOPs -> '4.45e24 FLOPs (4.45 yotta)'; the prefix is where the seeds' arithmetic went wrong."""
    for exponent, prefix in ((24, "yotta"), (21, "zetta"), (18, "exa"), (15, "peta"), (12, "tera"), (9, "giga")):
        if value >= 10**exponent:
            return f"{value:.4g} {unit} ({value / 10**exponent:.4g} {prefix}{unit})"
    return f"{value:.4g} {unit}"


def plan(config: GLM46Config, layout: Layout, hardware: Hardware, tokens: float, seq_len: int, micro_batch: int,
         optimizer: str, activation_checkpointing: bool, pipeline_parallel: int = 1) -> dict:
    counts = count_parameters(config)
    flops_per_token = training_flops_per_token(config, seq_len)
    total_flops = flops_per_token * tokens
    cluster_flops = hardware.world_size * hardware.peak_tflops * 1e12 * hardware.mfu
    gpu_hours = total_flops / (hardware.peak_tflops * 1e12 * hardware.mfu) / 3600
    memory = memory_per_gpu(config, layout, micro_batch * seq_len, optimizer, activation_checkpointing)
    capacity = hardware.memory_gib * GIB * MARGIN
    notes = []
    if pipeline_parallel > 1:
        notes.append(f"pipeline_parallel={pipeline_parallel} is not offered by Lightning (no strategy splits layers "
                     f"into stages); this plan uses pipeline_parallel=1")
    if memory["total"] > capacity:
        floor = memory["activations"] + memory["gathered layer (FSDP2)"]
        if floor > capacity:
            fix = (f"even fully sharded, one micro-batch's activations need {floor / GIB:.1f} GiB: this layout needs "
                   f"pipeline (or context) parallelism, which the engine does not offer"
                   + ("" if activation_checkpointing else "; or turn on parallelism.activation_checkpointing"))
        else:
            fix = "shard more (data_parallel_shard=-1, expert_parallel) or turn on activation checkpointing"
        notes.append(f"does not fit: {memory['total'] / GIB:.1f} GiB per GPU > {MARGIN:.0%} of "
                     f"{hardware.memory_gib:g} GiB; {fix}")
    return {
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
        "fits": memory["total"] <= capacity,
        "notes": notes,
    }


def format_plan(result: dict, hardware: Hardware, layout: Layout) -> str:
    counts = result["parameters"]
    lines = [
        f"parameters: total {counts['total']:,}, active per token {counts['active']:,}",
        f"FLOPs per token (6 x active + lm_head/MTP + attention): {result['flops_per_token']:.4g}",
        f"tokens: {result['tokens']:.4g}",
        f"training FLOPs: {si(result['total_flops'], 'FLOPs')}; 6 x active x tokens alone: "
        f"{si(result['six_n_flops'], 'FLOPs')}",
        f"cluster: {hardware.num_nodes} nodes x {hardware.devices} {hardware.gpu_name} = {hardware.world_size} GPUs "
        f"at {hardware.peak_tflops:g} TFLOP/s bf16 and an assumed MFU of {hardware.mfu:.0%}",
        f"throughput: {result['tokens_per_second']:,.0f} tokens/s; {result['gpu_hours']:,.0f} GPU-hours = "
        f"{result['days']:,.1f} days; cost {result['cost']:,.0f} at {hardware.price_per_gpu_hour:g} per GPU-hour",
        f"layout: world {layout.world_size} = tp {layout.tensor_parallel} x dp {layout.data_parallel} "
        f"(ep {layout.expert_parallel}, FSDP shard {layout.data_parallel_shard})",
        "memory per GPU:",
    ]
    lines += [f"  {name:24s} {value / GIB:9.2f} GiB" for name, value in result["memory"].items()]
    lines.append(f"  fits {hardware.memory_gib:g} GiB (with a 10% margin): {'yes' if result['fits'] else 'NO'}")
    lines += [f"note: {note}" for note in result["notes"]]
    return "\n".join(lines)
