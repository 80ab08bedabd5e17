"""GLM-4.6's shape built from torchtitan's own modules: the peer of bench/train_throughput.py.

torchtitan (pip `torchtitan`, 0.3) composes its decoders from configs; its Qwen3 decoder block takes either a
dense FFN or its MoE, and its MoE takes a sigmoid router with the correction bias (`expert_bias_E`, moved by its
load-balancing hook, not by gradients), route normalisation and scaling, a shared expert and its grouped experts
(`torch._grouped_mm`, always in bf16). So the GLM-4.6 block is expressible with torchtitan's classes and no code
of ours in its forward. Where it has to differ from GLM-4.6 (and from glm46.modules):

- RoPE covers the whole head (torchtitan's `CosSinRoPE` rotates `head_dim`); GLM rotates half of it. Elementwise
  work only: no FLOPs counted for either.
- Attention is torchtitan's `ScaledDotProductAttention` (plain causal SDPA, as ours runs on single-document rows).
  Its language models default to FlexAttention or varlen, which need document positions; FlexAttention has no CPU
  backward in torch 2.13 and varlen is CUDA-only. `--titan-attention flex` selects FlexAttention on a GPU.
- No MTP layer (torchtitan's MTP is DeepSeek-V3's, with MLA): the comparison rows run ours without MTP.
- q/k/v are one fused `wqkv` (torchtitan's default for Qwen3): the same weights, one GEMM instead of three.

Everything else is the same function: tests/test_bench_peers.py loads glm46 weights into this model and checks
the logits against glm46's with `partial_rotary_factor=1`.
"""

from __future__ import annotations

from functools import partial

import torch
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.config_utils import (
    make_ffn_config,
    make_gqa_config,
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

from glm46.modules import GLM46Config, GLM46ForCausalLM

LINEAR_INIT = {"weight": partial(torch.nn.init.normal_, std=0.02), "bias": torch.nn.init.zeros_}
EXPERTS_INIT = {name: LINEAR_INIT["weight"] for name in ("w1_EFD", "w2_EDF", "w3_EFD")}
ATTENTION = {"sdpa": ScaledDotProductAttention.Config, "flex": FlexAttention.Config}


def _norm(dim: int, eps: float) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=dim, eps=eps, param_init={"weight": torch.nn.init.ones_})


def _ffn(dim: int, hidden: int):
    return make_ffn_config(dim=dim, hidden_dim=hidden, w1_param_init=LINEAR_INIT, w2w3_param_init=LINEAR_INIT)


def _layer(config: GLM46Config, index: int, seq_len: int, attention: str) -> Qwen3TransformerBlock.Config:
    dim, eps = config.hidden_size, config.rms_norm_eps
    gqa = make_gqa_config(
        dim=dim,
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        wqkv_param_init=LINEAR_INIT,
        wo_param_init=LINEAR_INIT,
        inner_attention=ATTENTION[attention](),
        fuse_qkv=True,
        qk_norm=_norm(config.head_dim, eps) if config.use_qk_norm else None,
        rope=CosSinRoPE.Config(dim=config.head_dim, max_seq_len=seq_len, theta=config.rope_theta),
    )
    gqa.qkv_linear.wqkv.bias = config.attention_bias
    block = dict(attention_norm=_norm(dim, eps), ffn_norm=_norm(dim, eps), attention=gqa)
    if index < config.first_k_dense_replace:
        return Qwen3TransformerBlock.Config(**block, feed_forward=_ffn(dim, config.intermediate_size))
    experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    router = make_router_config(
        dim=dim,
        num_experts=experts,
        gate_param_init=LINEAR_INIT,
        top_k=top_k,
        score_func="sigmoid",
        route_norm=config.norm_topk_prob,
        route_scale=config.routed_scaling_factor,
        num_expert_groups=config.n_group if config.n_group > 1 else None,
        num_limited_groups=config.topk_group if config.n_group > 1 else None,
    )
    routed = make_routed_experts_config(
        dim=dim,
        hidden_dim=config.moe_intermediate_size,
        num_experts=experts,
        top_k=top_k,
        param_init=EXPERTS_INIT,
        comm_backend="standard",
    )
    shared = _ffn(dim, config.moe_intermediate_size * config.n_shared_experts) if config.n_shared_experts else None
    moe = make_moe_config(num_experts=experts, router=router, routed_experts=routed, shared_experts=shared)
    return Qwen3TransformerBlock.Config(**block, moe=moe)


def torchtitan_glm(config: GLM46Config, seq_len: int, attention: str = "sdpa") -> Qwen3Model:
    """torchtitan's decoder with `config`'s shape (no MTP layer), initialised as torchtitan's trainer does."""
    dim, vocab = config.hidden_size, config.vocab_size
    model_config = Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=_norm(dim, config.rms_norm_eps),
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init={"weight": LINEAR_INIT["weight"]}
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=LINEAR_INIT),
        layers=[_layer(config, i, seq_len, attention) for i in range(config.num_hidden_layers)],
    )
    model = model_config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def glm46_state_dict(model: GLM46ForCausalLM) -> dict[str, torch.Tensor]:
    """glm46's weights under torchtitan's names (its stock wq/wk/wv keys, which its fused wqkv loads)."""
    config = model.config
    names = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
    names["lm_head.weight"] = "lm_head.weight"
    per_layer = {
        "self_attn.q_proj": "attention.qkv_linear.wq",
        "self_attn.k_proj": "attention.qkv_linear.wk",
        "self_attn.v_proj": "attention.qkv_linear.wv",
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
            out[prefix + "moe.routed_experts.inner_experts.w1_EFD"] = gate
            out[prefix + "moe.routed_experts.inner_experts.w3_EFD"] = up
        elif rest == "mlp.experts.down_proj":
            out[prefix + "moe.routed_experts.inner_experts.w2_EDF"] = tensor
        elif rest == "mlp.gate.e_score_correction_bias":
            out[prefix + "moe.expert_bias_E"] = tensor
        else:
            out[prefix + per_layer[module] + "." + leaf] = tensor
    assert config.num_nextn_predict_layers == 0, "torchtitan's GLM has no MTP layer"
    return out
