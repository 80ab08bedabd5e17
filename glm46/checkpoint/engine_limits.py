"""What an inference engine refuses in a GLM-4.5/4.6 export, said before it is launched.

The model config itself already refuses what no engine serves (glm46.modules.config: non-silu activations,
tied embeddings, groups of fewer than 2 experts, an odd rotary dim). Left here are limits of one engine,
device or launch:
- vLLM's CPU attention takes only some head sizes (`CPUAttentionBackend.get_supported_head_sizes`, vllm
  0.32 `vllm/v1/attention/backends/cpu_attn.py`); any other loads, then fails at the first forward with
  "Unsupported CPU attention configuration: head_dim=...".
- Tensor parallelism splits the query heads, and the key/value heads or their replicas, across ranks
  (vLLM `QKVParallelLinear`, SGLang likewise).
- MTP speculative decoding needs MTP layers in the export (`num_nextn_predict_layers` >= 1).
"""

from __future__ import annotations

from glm46.modules.config import GLM46Config

VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def serving_problems(
    config: GLM46Config,
    engine: str = "vllm",
    device: str = "cpu",
    tensor_parallel_size: int = 1,
    mtp: bool = False,
    tp_key: str = "serve.tensor_parallel_size",
) -> list[str]:
    """Why `engine` on `device` would refuse to serve a model of `config`, one message per key (the model's, or
    task=serve's `serve.*`; tp_key names the tensor-parallel one); [] if it would not. The defaults are the
    strictest target this project tests: vLLM's CPU build, one process."""
    problems = []
    if engine == "vllm" and device == "cpu" and config.head_dim not in VLLM_CPU_HEAD_DIMS:
        problems.append(
            f"head_dim={config.head_dim}: vLLM's CPU attention takes head_dim in {list(VLLM_CPU_HEAD_DIMS)}; "
            f"this model loads there but fails at its first forward (GPU builds may serve it)"
        )
    tp, heads, kv_heads = tensor_parallel_size, config.num_attention_heads, config.num_key_value_heads
    if heads % tp:
        problems.append(f"{tp_key}={tp} must divide num_attention_heads={heads}")
    if kv_heads % tp and tp % kv_heads:
        problems.append(
            f"{tp_key}={tp} must divide num_key_value_heads={kv_heads} or be a multiple of it "
            f"(each rank holds whole key/value heads)"
        )
    if mtp and config.num_nextn_predict_layers < 1:
        problems.append(
            "serve.mtp=true: the export has no MTP layer (num_nextn_predict_layers=0) to draft speculative tokens with"
        )
    return problems
