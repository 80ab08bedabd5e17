"""The training benchmark's torchtitan peer (bench/torchtitan_glm.py) is GLM-4.6's model built from torchtitan's
modules: with glm46's weights, and RoPE over the whole head (the one thing its attention cannot do otherwise), its
logits are glm46's. So bench/train_throughput.py compares two implementations of one function."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.torchtitan_glm import glm46_state_dict, torchtitan_glm
from glm46.modules import GLM46ForCausalLM

from .helpers import tiny_config

SEQ = 32
ROOT = Path(__file__).resolve().parents[1]


def models(**overrides):
    config = tiny_config(
        partial_rotary_factor=1.0,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
        attention_bias=True,
        num_nextn_predict_layers=0,
        **overrides,
    )
    torch.manual_seed(0)
    ours = GLM46ForCausalLM(config)
    with torch.no_grad():  # every weight away from its init value, so that a misplaced one shows in the logits
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for module in ours.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.1)  # it steers the selection
    titan = torchtitan_glm(config, SEQ, grouped_mm=False)  # its CPU path: the per-expert loop
    titan.load_state_dict(glm46_state_dict(ours), strict=True)  # every key and shape, both ways
    return ours, titan


def token_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The median over tokens of the relative error of the logits. The median, because rounding may flip a
    near-tie in the top-k routing of a token or two, which then differ by O(1) in both directions."""
    return ((a - b).norm(dim=-1) / a.norm(dim=-1)).median().item()


@pytest.mark.parametrize("groups", [1, 2], ids=["ungrouped", "group-limited"])
def test_torchtitan_peer_computes_glm46(groups):
    ours, titan = models(n_group=groups, topk_group=1)
    assert sum(p.numel() for p in titan.parameters()) == sum(p.numel() for p in ours.parameters())
    x = torch.randint(0, ours.config.vocab_size, (2, SEQ))
    # fp32 on both sides (torchtitan's per-expert loop, its CPU path): equal to rounding (measured: a median of 0.0);
    # a misplaced weight (gate for up, a wrong q/k/v head order) is off by tens of percent.
    with torch.no_grad():
        expected, got = ours(x).logits, titan(x)
    assert token_error(expected, got) < 1e-5

    layer = next(block for block in titan.layers.values() if block.moe_enabled)
    gate, up = layer.moe.experts.w1, layer.moe.experts.w3
    with torch.no_grad():  # the control: swapping the experts' gate and up projections must show
        gate.data, up.data = up.data.clone(), gate.data.clone()
        assert token_error(expected, titan(x)) > 0.1


@pytest.mark.slow
def test_throughput_bench_runs_both_peers_in_one_process(tmp_path):
    """The bench itself: one step of each runner, every glm46 row with its ratio to both peers. Without pandas, as on
    the GPU image: torchtitan's models import its dataset loaders, which import `datasets`, which needs pandas;
    bench/torchtitan_glm.py stands in for `datasets` there."""
    (tmp_path / "pandas").mkdir()
    (tmp_path / "pandas" / "__init__.py").write_text("raise ImportError('no pandas, as on the GPU image')\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "bench/train_throughput.py", "--peer", "torchtitan", "transformers"]
    command += ["--batch", "1", "--steps", "1", "--warmup", "0"]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True, env=env).stdout
    rows = [line for line in out.splitlines() if " tokens/s " in line]
    assert [row.split(" (")[0] for row in rows] == ["glm46", "glm46", "torchtitan", "transformers Glm4Moe"]
    for row in rows[:2]:
        assert " vs torchtitan (fwd+bwd x" in row and " vs transformers (fwd+bwd x" in row, row


def test_the_float8_runner_trains_the_decoder_linears_in_float8_near_the_fp32_loss():
    """bench/gpu_suite.py's float8 row (torchao's converter): the attention and MLP linears of the decoder layers
    become Float8Linear, the lm_head stays; the same parameters and keys; the loss within float8's rounding (2%)."""
    from torchao.float8.float8_linear import Float8Linear

    from bench.train_throughput import PRESETS, glm46_loss, ours, ours_float8

    fields, device = PRESETS["small"][0], torch.device("cpu")
    plain, float8 = ours(fields, device, None, "adamw"), ours_float8(fields, device, None)
    converted = {name for name, m in float8.model.named_modules() if isinstance(m, Float8Linear)}
    assert converted and all(name.startswith("model.layers.") for name in converted)
    assert "model.layers.0.self_attn.q_proj" in converted and "lm_head" not in converted
    assert list(float8.model.state_dict()) == list(plain.model.state_dict())
    x = torch.randint(0, fields["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
    reference, loss = glm46_loss(plain.model, x), glm46_loss(float8.model, x)
    assert abs(loss.item() - reference.item()) < 0.02 * reference.item()
    loss.backward()
    weights = {id(p) for group in float8.optimizer.param_groups for p in group["params"]}
    q_proj = float8.model.model.layers["0"].self_attn.q_proj.weight
    assert id(q_proj) in weights and q_proj.grad is not None and q_proj.grad.isfinite().all()
