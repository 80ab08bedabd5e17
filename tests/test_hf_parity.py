"""Numerical parity with transformers' Glm4MoeForCausalLM, both directions, through real checkpoint files."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM

from glm46.checkpoint.hub_files import INDEX_FILE
from glm46.hf import load_hf, save_hf

from .helpers import TINY, random_model, randomise, relative_error, tiny_config

VARIANTS = {
    "glm46_shape": dict(use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5),
    "air_shape": dict(use_qk_norm=False, attention_bias=True, routed_scaling_factor=1.0),
    "no_bias_no_norm_topk": dict(attention_bias=False, norm_topk_prob=False, use_qk_norm=True),
    "grouped_routing": dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4),
    "dense_first_2_mha": dict(first_k_dense_replace=2, num_hidden_layers=4, num_key_value_heads=4),
    "head_dim_not_hidden_over_heads_rotary_quarter": dict(
        head_dim=48, num_attention_heads=6, num_key_value_heads=2, partial_rotary_factor=0.25
    ),
    "two_mtp_layers": dict(num_nextn_predict_layers=2),
}

TOLERANCE = 1e-6  # fp32 relative logits error; measured at most 2.2e-7 over VARIANTS


def hf_config(**overrides) -> Glm4MoeConfig:
    fields = {**TINY, **overrides}
    rope = {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "partial_rotary_factor": fields.pop("partial_rotary_factor", 0.5),
    }
    fields.pop("num_nextn_predict_layers", None)
    return Glm4MoeConfig(**fields, rope_parameters=rope, num_mtp_layers=0)


def tokens(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS)
def test_ours_to_transformers(variant, tmp_path):
    config = tiny_config(**VARIANTS[variant])
    ours = random_model(config)
    save_hf(ours, tmp_path, max_shard_bytes=300_000)
    assert (tmp_path / INDEX_FILE).exists(), "expected a sharded checkpoint with an index"

    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    mtp_prefixes = tuple(
        f"model.layers.{config.num_hidden_layers + j}." for j in range(config.num_nextn_predict_layers)
    )
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert [k for k in info["unexpected_keys"] if not k.startswith(mtp_prefixes)] == []
    assert info["mismatched_keys"] == set() or not info["mismatched_keys"]

    x = tokens(config.vocab_size)
    with torch.no_grad():
        error = relative_error(ours(x).logits, hf.eval()(x).logits)
    assert error <= TOLERANCE, f"{variant}: relative logits error {error:.2e}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_to_ours(variant, tmp_path, caplog):
    overrides = VARIANTS[variant]
    hf = randomise(Glm4MoeForCausalLM(hf_config(**overrides)), seed=3)
    hf.save_pretrained(tmp_path, max_shard_size="300KB")

    ours = load_hf(tmp_path)  # transformers writes no MTP layer: ours is initialised afresh, with a warning
    assert ours.config.partial_rotary_factor == overrides.get("partial_rotary_factor", 0.5)
    assert ours.config.head_dim == overrides.get("head_dim", TINY["head_dim"])
    x = tokens(ours.config.vocab_size)
    with torch.no_grad():
        error = relative_error(ours(x).logits, hf(x).logits)
    assert error <= TOLERANCE, f"{variant}: relative logits error {error:.2e}"


def test_hub_layout_has_per_expert_keys_and_mtp_as_last_layer(tmp_path):
    config = tiny_config()
    save_hf(random_model(config), tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    L, E = config.num_hidden_layers, config.n_routed_experts
    for e in range(E):
        for part in ("gate", "up", "down"):
            assert f"model.layers.1.mlp.experts.{e}.{part}_proj.weight" in keys
    assert not any(k.endswith("gate_up_proj") for k in keys)
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "mlp.gate", "self_attn.q_proj"):
        assert f"model.layers.{L}.{name}.weight" in keys
    assert f"model.layers.{L}.mlp.gate.e_score_correction_bias" in keys
    hf_config_json = json.loads((tmp_path / "config.json").read_text())
    assert hf_config_json["model_type"] == "glm4_moe" and hf_config_json["num_nextn_predict_layers"] == 1


def test_bf16_export_keeps_correction_bias_fp32(tmp_path):
    model = random_model(tiny_config()).to(torch.bfloat16)
    assert all(r.e_score_correction_bias.dtype == torch.float32 for r in model.routers())
    save_hf(model, tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
        assert f.get_tensor("model.layers.1.self_attn.q_proj.weight").dtype == torch.bfloat16
    loaded = load_hf(tmp_path, dtype=torch.bfloat16)
    for a, b in zip(model.routers(), loaded.routers()):
        assert torch.equal(a.e_score_correction_bias, b.e_score_correction_bias)
