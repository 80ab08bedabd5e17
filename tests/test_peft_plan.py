"""task=plan and task=dryrun with adapters (peft=lora|dora): the frozen base at peft.base_dtype without gradients or
optimizer state, the adapters in fp32 with AdamW's moments, sharded as the layout shards them; the fine-tuning
recipes' verdicts (experiment=glm45_air_lora, glm45_355b_dora, and full fine-tuning on LoRA's 8 GPUs)."""

from __future__ import annotations

import math

import pytest
import torch

from glm46.config.aliases import renamed_overrides
from glm46.config.checks import model_config
from glm46.modules import GLM46Config, GLM46ForCausalLM
from glm46.peft import AdapterSettings, adapter_parameters, add_adapters
from glm46.peft.settings import peft_settings
from glm46.planning.dryrun import TRANSIENT
from glm46.planning.plan import GIB, format_plan
from glm46.planning.sizing import composed_plan

from .test_dryrun import dry_run, figures

FITS = "fits 80 GiB (with a 10% margin): "


def planned(compose_config, *overrides: str):
    """(the composition, glm46.planning.plan's result, the printed plan) of the command line `overrides`."""
    cfg = compose_config(*renamed_overrides(["task=plan", *overrides]))
    result, hardware, layout = composed_plan(cfg, model_config(cfg))
    return cfg, result, format_plan(result, hardware, layout)


def verdict(text: str) -> str:
    return next(line.strip() for line in text.splitlines() if FITS in line).removeprefix(FITS)


def built_adapters(config: GLM46Config, settings: AdapterSettings) -> int:
    """The adapter parameters of the model built on meta with its adapters, as training builds it."""
    with torch.device("meta"):
        model = GLM46ForCausalLM(config)
    add_adapters(model, settings)
    return sum(p.numel() for p in adapter_parameters(model).values())


def adapter_formula(config: GLM46Config, r: int, dora: bool) -> int:
    """The adapters by their shapes: on a linear [out, in] A [r, in], B [out, r] (DoRA: a magnitude [out]); on a
    MoE layer's experts, per expert, A [E, r, in] and B [E, out, r] of gate_up [E, 2I, H] and down [E, H, I] (DoRA:
    a magnitude [E, out]); attention everywhere, the dense MLP on the first_k_dense_replace layers."""

    def linear(inputs: int, outputs: int, stack: int = 1) -> int:
        return stack * r * (inputs + outputs) + (stack * outputs if dora else 0)

    h, e = config.hidden_size, config.n_routed_experts
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    attention = linear(h, q) + 2 * linear(h, kv) + linear(q, h)

    def mlp(width: int) -> int:
        return 2 * linear(h, width) + linear(width, h)

    inter = config.moe_intermediate_size
    experts = linear(h, 2 * inter, e) + linear(inter, h, e)
    moe = mlp(inter * config.n_shared_experts) + experts
    dense = config.first_k_dense_replace
    return (
        config.num_hidden_layers * attention
        + dense * mlp(config.intermediate_size)
        + (config.num_hidden_layers - dense) * moe
    )


def test_lora_on_air_fits_one_node_where_full_fine_tuning_does_not(compose_config):
    cfg, lora, text = planned(compose_config, "experiment=glm45_air_lora")
    assert cfg.peft.base_dtype == "bfloat16" and cfg.peft.lr == 1e-4 and cfg.trainer.precision == "bf16-mixed"
    assert "layout: world 8 = tp 1 x pp 2 x dp 4 (ep 4, FSDP shard 4)" in text
    assert verdict(text) == "yes" and lora["fits"]
    memory = lora["memory"]
    assert memory["frozen base (bf16)"] > 20 * GIB and memory["gradients (fp32)"] < 0.05 * memory["frozen base (bf16)"]
    assert memory["optimizer (adamw)"] == 2 * memory["gradients (fp32)"] == 2 * memory["trained weights (fp32)"]
    _, full, full_text = planned(compose_config, "experiment=glm45_air_lora", "peft=null")
    assert "peft" not in full and "adapters (peft=" not in full_text
    assert verdict(full_text) == "NO" and not full["fits"]
    assert full["memory"]["total"] > 3 * memory["total"]  # fp32 masters, gradients and moments of every weight


def test_dora_on_glm45_fits_four_nodes(compose_config):
    cfg, result, text = planned(compose_config, "experiment=glm45_355b_dora")
    assert cfg.peft.method == "dora"
    assert "layout: world 32 = tp 2 x pp 4 x dp 4 (ep 4, FSDP shard 4)" in text
    assert verdict(text) == "yes" and result["fits"]


@pytest.mark.parametrize(
    ("model", "peft", "experts"),
    [("tiny", "lora", "per_expert"), ("tiny", "dora", "shared"), ("glm45_air_106b", "dora", "per_expert")],
)
def test_the_plans_adapter_count_is_the_built_models(compose_config, model, peft, experts):
    """The plan counts the adapters of the model built on meta with glm46.peft.add_adapters, whose shapes are
    adapter_formula's (a shared pair: one A and B for a layer's experts); the plan prints the count and its share of
    every parameter."""
    cfg, result, text = planned(
        compose_config,
        f"model={model}",
        f"peft={peft}",
        f"peft.experts={experts}",
        "peft.r=4",
        "trainer.precision=32-true",
    )
    config, settings = model_config(cfg), peft_settings(cfg)
    counts = result["peft"]
    assert counts["adapters"] == built_adapters(config, settings) > 0
    if experts == "per_expert":
        assert counts["adapters"] == adapter_formula(config, 4, settings.dora)
    else:  # one pair for a layer's experts
        moe = config.num_hidden_layers - config.first_k_dense_replace
        e, h, inter = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        per_expert_pairs = (e - 1) * 4 * ((h + 2 * inter) + (inter + h))
        assert counts["adapters"] == adapter_formula(config, 4, True) - moe * per_expert_pairs
    assert counts["total"] == result["parameters"]["total"] + counts["adapters"]
    assert f"{counts['adapters']:,} parameters = {counts['adapters'] / counts['total']:.3%} of all" in text
    assert result["memory"]["frozen base (fp32)"] > 0  # 32-true: the base stays in fp32 (peft.base_dtype)


def test_the_recipes_adapter_count_on_air_is_the_built_models(compose_config):
    cfg, result, _ = planned(compose_config, "experiment=glm45_air_lora")
    config, settings = model_config(cfg), peft_settings(cfg)
    assert result["peft"]["adapters"] == built_adapters(config, settings) == adapter_formula(config, settings.r, False)


def test_a_frozen_base_has_no_gradients_or_moments_in_any_pipeline_stage(compose_config):
    """Every pipeline rank: the trained tensors are the adapters alone, their shards sum to the adapters' count split
    over the rank's stage; the base's gradients and moments are zero."""
    _, result, _ = planned(compose_config, "experiment=glm45_air_lora")
    for memory in result["by_pipeline_rank"]:
        assert memory["trained weights (fp32)"] > 0 and memory["gradients (fp32)"] == memory["trained weights (fp32)"]
        assert memory["unsharded gradient (FSDP2)"] < 0.01 * memory["gathered (FSDP2)"]
    trained = sum(m["trained weights (fp32)"] for m in result["by_pipeline_rank"]) / 4  # fp32
    stage_ranks = 8 // 2  # the ranks of one pipeline stage, over which its adapters are split (EP 4 = FSDP shard 4)
    assert trained * stage_ranks == pytest.approx(result["peft"]["adapters"], rel=0.01)


def test_an_fp8_base_halves_the_frozen_bytes_of_lora_on_air(compose_config):
    """peft.base_dtype=fp8: the decoder layers' matrices at one byte each, the embedding, lm_head and MTP in bf16."""
    _, bf16, _ = planned(compose_config, "experiment=glm45_air_lora")
    cfg, fp8, text = planned(compose_config, "experiment=glm45_air_lora", "peft.base_dtype=fp8")
    assert "the base frozen in fp8" in text and verdict(text) == "yes"
    base, dense = fp8["memory"]["frozen base (fp8+bf16)"], bf16["memory"]["frozen base (bf16)"]
    assert 0.5 < base / dense < 0.52  # the bf16 embedding on pipeline rank 0 is the rest
    assert fp8["memory"]["gradients (fp32)"] == bf16["memory"]["gradients (fp32)"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("experiment", "rank"),
    [("glm45_air_lora", 0), ("glm45_355b_dora", 31), ("glm45_air_lora peft.base_dtype=fp8", 0)],
)
def test_the_dry_runs_shards_are_the_plans(compose_config, experiment, rank):
    """The real model with its adapters, sharded at the job's world size as one rank: its bytes by group (the frozen
    base in bf16, the adapters' fp32 weights, gradients and moments) are the plan's for its pipeline stage, and with
    the plan's transient memory its total is the plan's."""
    experiment, *overrides = experiment.split()
    run = figures(dry_run([f"experiment={experiment}", *overrides, f"dryrun.rank={rank}"]))
    assert run["state"] == run["planned"]
    adapters, base = run["state"]["adapters"], run["state"]["routed experts"]
    assert adapters["optimizer"] == 2 * adapters["gradients"] == 2 * adapters["weights"] > 0
    assert base["weights"] > 0 and base["gradients"] == base["optimizer"] == 0
    _, result, _ = planned(compose_config, f"experiment={experiment}", *overrides)
    stage = result["by_pipeline_rank"][-1 if rank else 0]
    held = sum(sum(kinds.values()) for kinds in run["state"].values())
    transient = sum(v for k, v in stage.items() if k.startswith(TRANSIENT))
    assert math.isclose(held + transient, stage["total"])
