"""What a colocated rollout engine (phase.rollout.engine=vllm, colocate=true) takes of each training GPU.

vLLM reserves `gpu_memory_utilization` of a GPU for itself (its weights, its activations and the KV cache that fills
the rest of its share), so the trainer keeps the remainder: task=plan adds the engine's share to the trainer's
memory. The engine's weights are the whole model (the MTP layers included: speculative rollouts load them) split
over its tensor-parallel GPUs, in bf16, or one byte a weight with FP8 rollouts (GLM-4.5, section 3.5: block-wise FP8
quantized at each weight update); they must leave room for a KV cache inside the share.
"""

from __future__ import annotations

from glm46.modules import GLM46Config

from .counts import count_parameters
from .plan import GIB, MARGIN, Hardware


def engine_weight_bytes(config: GLM46Config, tensor_parallel_size: int, quantization: str | None, dtype: str) -> float:
    """The engine's weights on each of its GPUs."""
    per_weight = 1 if quantization == "fp8" else (4 if dtype == "float32" else 2)
    return count_parameters(config)["total"] * per_weight / tensor_parallel_size


def kv_bytes_per_token(config: GLM46Config, tensor_parallel_size: int) -> float:
    """Keys and values of one token on one engine GPU, bf16: the key/value heads split over the tensor-parallel
    ranks, replicated beyond their number (vLLM's QKVParallelLinear)."""
    heads = config.num_key_value_heads / min(tensor_parallel_size, config.num_key_value_heads)
    return config.num_hidden_layers * 2 * heads * config.head_dim * 2


def add_colocated_engine(result: dict, config: GLM46Config, rollout, hardware: Hardware) -> None:
    """Count the engine's share in `result` (glm46.planning.plan.plan's) in place: its memory table, fits, notes."""
    share = rollout.gpu_memory_utilization * hardware.memory_gib * GIB
    weights = engine_weight_bytes(config, rollout.tensor_parallel_size, rollout.quantization, rollout.dtype)
    memory = result["memory"]
    engine = max(share, weights)  # weights beyond the share would still be loaded (and vLLM then refuses to start)
    total = memory.pop("total") + engine
    tokens = (engine - weights) / kv_bytes_per_token(config, rollout.tensor_parallel_size)
    memory["rollout engine weights"] = weights
    memory[f"rollout KV ({tokens / 1e3:,.0f}K tokens)"] = engine - weights
    memory["total"] = total
    result["fits"] = total <= hardware.memory_gib * GIB * MARGIN and weights <= share
    precision = "fp8" if rollout.quantization == "fp8" else "bf16"
    if weights > share:
        result["notes"].append(
            f"the rollout engine's {precision} weights need {weights / GIB:.1f} GiB per GPU at "
            f"phase.rollout.tensor_parallel_size={rollout.tensor_parallel_size}, more than its share "
            f"(phase.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization:g}: {share / GIB:.1f} GiB): "
            f"raise either, or quantize the rollouts (phase.rollout.quantization=fp8)"
        )
    elif not result["fits"]:
        result["notes"].append(
            f"the trainer and the colocated rollout engine ({share / GIB:.1f} GiB, "
            f"phase.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization:g}) do not fit together: "
            f"lower the engine's share or the trainer's memory"
        )
