"""GLM-4.6's shape built from torchtitan's own modules: the peer of bench/train_throughput.py and bench/gpu_suite.py.

torchtitan 0.2.2 (pip `torchtitan`; the last release that imports under torch 2.11, the GPU image's, as under this
machine's 2.13) has a Qwen3 decoder whose blocks take its MoE: a sigmoid router with the correction bias
(`expert_bias`, moved by its load-balancing hook, not by gradients), route normalisation and scaling, group-limited
routing, a shared expert and its grouped experts (`torch._grouped_mm`, always in bf16). So the GLM-4.6 block is
torchtitan's code in every forward; only the model's assembly is ours. Where it has to differ from GLM-4.6 (and from
glm46.modules):

- RoPE covers the whole head (torchtitan's Qwen3 rotates `head_dim`); GLM rotates half of it. Elementwise work only:
  no FLOPs counted for either.
- Attention is torchtitan's SDPA wrapper (plain causal, as ours runs on single-document rows); `--titan-attention
  flex` selects its FlexAttention (no CPU backward in torch 2.13).
- No MTP layer (torchtitan's MTP is DeepSeek-V3's, with MLA): the comparison rows run ours without MTP.
- Qwen3's config makes every block MoE or every block dense, and its q/k/v have no bias: the first
  `first_k_dense_replace` blocks get torchtitan's dense FeedForward in place of the MoE, and q/k/v get their bias
  (GLM's `attention_bias`), after construction.
- On the CPU (tests, bench/train_throughput.py): its grouped experts pad the expert groups with a Triton kernel
  that needs a GPU, so the CPU runs its per-expert loop (`grouped_mm=False`, fp32); and its router counts tokens
  per expert with `torch.histc` of int64 expert ids, which CUDA implements and the CPU does not, so the CPU counts
  the ids as floats (exact below 2**24). On a GPU it runs as shipped.

Everything else is the same function: tests/test_bench_peers.py loads glm46 weights into this model and checks
the logits against glm46's with `partial_rotary_factor=1`.
"""

from __future__ import annotations

import sys
import types
from contextlib import nullcontext

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


def _stand_in_for_hf_datasets() -> None:
    """torchtitan's model modules import its training protocol, which imports its Hugging Face dataset loaders, which
    import `datasets` (with pandas and pyarrow: binary wheels the GPU image lacks, over 50 MiB together). This peer
    loads no data through torchtitan: where `datasets` does not import, the two names those loaders take stand in,
    raising ImportError if ever called."""
    try:
        import datasets  # noqa: F401
    except ImportError as error:
        reason = f"torchtitan's dataset loaders need `datasets`, which does not import here ({error})"

        def unavailable(*args, **kwargs):
            raise ImportError(reason)

        stand_in, distributed = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
        stand_in.Dataset, stand_in.load_dataset = type("Dataset", (), {}), unavailable
        stand_in.distributed, distributed.split_dataset_by_node = distributed, unavailable
        sys.modules.update({"datasets": stand_in, "datasets.distributed": distributed})


_stand_in_for_hf_datasets()

from torchtitan.models.moe import MoEArgs  # noqa: E402
from torchtitan.models.moe.moe import FeedForward  # noqa: E402
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs  # noqa: E402
from torchtitan.models.qwen3.model.model import Qwen3Model  # noqa: E402

from glm46.modules import GLM46Config, GLM46ForCausalLM  # noqa: E402


class _FloatHistc(TorchFunctionMode):
    """torch.histc of integers counted as floats (the CPU's histc takes floating-point inputs only)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.histc and not args[0].is_floating_point():
            return func(args[0].float(), *args[1:], **(kwargs or {})).to(args[0].dtype)  # as CUDA's: the input's
        return func(*args, **(kwargs or {}))


class GLMQwen3Model(Qwen3Model):
    """torchtitan's Qwen3Model, its router's expert counts taken as floats on the CPU."""

    def forward(self, tokens: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        with _FloatHistc() if tokens.device.type == "cpu" else nullcontext():
            return super().forward(tokens, *args, **kwargs)


def torchtitan_glm(
    config: GLM46Config, seq_len: int, attention: str = "sdpa", grouped_mm: bool = True
) -> GLMQwen3Model:
    """torchtitan's decoder with `config`'s shape (no MTP layer), initialised as torchtitan's trainer does.
    grouped_mm: its grouped experts in bf16 (a GPU), else its per-expert loop (the CPU)."""
    grouped = config.n_group > 1
    args = Qwen3ModelArgs(
        dim=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads,
        vocab_size=config.vocab_size,
        head_dim=config.head_dim,
        hidden_dim=config.intermediate_size,
        norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        qk_norm=config.use_qk_norm,
        max_seq_len=seq_len,
        attn_type=attention,
        moe_enabled=True,
        moe_inter_dim=config.moe_intermediate_size,
        moe_args=MoEArgs(
            num_experts=config.n_routed_experts,
            num_shared_experts=config.n_shared_experts,
            score_func="sigmoid",
            route_norm=config.norm_topk_prob,
            route_scale=config.routed_scaling_factor,
            score_before_experts=False,  # GLM weights each expert's output, not its input
            top_k=config.num_experts_per_tok,
            use_grouped_mm=grouped_mm,
            num_expert_groups=config.n_group if grouped else None,
            num_limited_groups=config.topk_group if grouped else None,
        ),
    )
    model = GLMQwen3Model(args)
    for index, block in model.layers.items():
        if int(index) < config.first_k_dense_replace:
            del block.moe
            block.moe_enabled = False
            block.feed_forward = FeedForward(config.hidden_size, config.intermediate_size)
        if config.attention_bias:
            for name in ("wq", "wk", "wv"):
                linear = getattr(block.attention, name)
                setattr(block.attention, name, nn.Linear(linear.in_features, linear.out_features, bias=True))
    with torch.no_grad():
        model.init_weights()
        for block in model.layers.values():  # init_weights leaves the added biases as nn.Linear made them
            for name in ("wq", "wk", "wv"):
                bias = getattr(block.attention, name).bias
                if bias is not None:
                    bias.zero_()
    return model


def glm46_state_dict(model: GLM46ForCausalLM) -> dict[str, torch.Tensor]:
    """glm46's weights under torchtitan's names."""
    config = model.config
    assert config.num_nextn_predict_layers == 0, "torchtitan's GLM has no MTP layer"
    names = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "self_attn.q_proj": "attention.wq",
        "self_attn.k_proj": "attention.wk",
        "self_attn.v_proj": "attention.wv",
        "self_attn.o_proj": "attention.wo",
        "self_attn.q_norm": "attention.q_norm",
        "self_attn.k_norm": "attention.k_norm",
        "input_layernorm": "attention_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "feed_forward.w1",
        "mlp.up_proj": "feed_forward.w3",
        "mlp.down_proj": "feed_forward.w2",
        "mlp.gate": "moe.router.gate",
        "mlp.shared_experts.gate_proj": "moe.shared_experts.w1",
        "mlp.shared_experts.up_proj": "moe.shared_experts.w3",
        "mlp.shared_experts.down_proj": "moe.shared_experts.w2",
    }
    out = {}
    for name, tensor in model.state_dict().items():
        if name in names:
            out[names[name]] = tensor
            continue
        _, _, layer, rest = name.split(".", 3)  # model.layers.{i}.{rest}
        prefix = f"layers.{layer}."
        module, _, leaf = rest.rpartition(".")
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            gate, up = tensor.chunk(2, dim=1)
            out[prefix + "moe.experts.w1"], out[prefix + "moe.experts.w3"] = gate, up
        elif rest == "mlp.experts.down_proj":  # [E, H, I]
            out[prefix + "moe.experts.w2"] = tensor
        elif rest == "mlp.gate.e_score_correction_bias":
            out[prefix + "moe.expert_bias"] = tensor
        else:
            out[prefix + per_layer[module] + "." + leaf] = tensor
    return out
