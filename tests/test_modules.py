"""The building blocks, each against a direct computation."""

import pytest
import torch
import torch.nn.functional as F

from glm46.modules import GLM46ForCausalLM
from glm46.modules.experts import grouped_linear
from glm46.modules.loss import IGNORE_INDEX, chunked_cross_entropy
from glm46.modules.model import initialize
from glm46.modules.moe import MoE
from glm46.modules.router import TopkRouter

from .helpers import random_model, tiny_config


def test_grouped_linear_equals_per_expert_linear_including_empty_experts():
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    for in_dim, out_dim in ((16, 8), (12, 6)):  # aligned rows take F.grouped_mm, unaligned the loop
        x = torch.randn(int(counts.sum()), in_dim, requires_grad=True)
        w = torch.randn(4, out_dim, in_dim, requires_grad=True)
        got = grouped_linear(x, w, counts)
        expected = torch.cat([F.linear(xe, we) for xe, we in zip(x.split(counts.tolist()), w)])
        torch.testing.assert_close(got, expected)
        grad = torch.randn_like(got)
        gx, gw = torch.autograd.grad(got, (x, w), grad)
        ex, ew = torch.autograd.grad(expected, (x, w), grad)
        torch.testing.assert_close(gx, ex)
        torch.testing.assert_close(gw, ew)


def test_moe_equals_token_by_token_expert_sum():
    config = tiny_config(n_routed_experts=8, num_experts_per_tok=3, routed_scaling_factor=2.5)
    torch.manual_seed(1)
    moe = MoE(config)
    initialize(moe.modules(), std=0.1)
    moe.gate.e_score_correction_bias.normal_(0, 0.05)
    x = torch.randn(2, 5, config.hidden_size)
    out, stats = moe(x)
    counts = stats.counts

    flat = x.view(-1, config.hidden_size)
    weights, indices, _ = moe.gate(flat)
    expected = moe.shared_experts(flat).clone()
    for t in range(flat.shape[0]):
        for w, e in zip(weights[t], indices[t]):
            gate, up = F.linear(flat[t], moe.experts.gate_up_proj[e]).chunk(2)
            expected[t] += w * F.linear(F.silu(gate) * up, moe.experts.down_proj[e])
    torch.testing.assert_close(out.view(-1, config.hidden_size), expected)
    assert counts.tolist() == torch.bincount(indices.flatten(), minlength=8).tolist()
    assert counts.sum() == flat.shape[0] * 3


def test_correction_bias_steers_selection_but_not_weights():
    config = tiny_config(n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5)
    router = TopkRouter(config)
    torch.nn.init.normal_(router.weight, std=0.1)
    x = torch.randn(10, config.hidden_size)
    router.e_score_correction_bias[5] = 10.0  # every token must pick expert 5
    weights, indices, scores = router(x)
    assert (indices == 5).any(dim=1).all()
    picked = scores.gather(1, indices)
    torch.testing.assert_close(weights, 2.5 * picked / picked.sum(dim=1, keepdim=True))


def test_group_limited_routing_picks_only_from_top_groups():
    config = tiny_config(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
    router = TopkRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    _, indices, scores = router(torch.randn(32, config.hidden_size))
    group_scores = scores.view(32, 4, 4).topk(2, dim=-1).values.sum(-1)
    top_groups = group_scores.topk(2, dim=-1).indices
    for token in range(32):
        assert set((indices[token] // 4).tolist()) <= set(top_groups[token].tolist())


@pytest.mark.parametrize("chunk_size", [4, 64], ids=["chunks-recomputed", "one-chunk"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_chunked_cross_entropy_equals_full_cross_entropy_with_gradients(chunk_size, autocast):
    """The hand-written backward (softmax - onehot over the logits) against autograd through F.linear +
    F.cross_entropy, with ignored tokens, several chunks or one, and under bf16 autocast (same matmul dtype)."""
    torch.manual_seed(2)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :3] = IGNORE_INDEX
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got = chunked_cross_entropy(hidden, weight, labels, chunk_size=chunk_size)
        logits = F.linear(hidden, weight).float().flatten(0, 1)
        expected = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(got, expected)
    # bf16: each chunk's weight gradient is rounded to bf16 before the chunks are summed (the whole batch's once)
    tolerance = dict(rtol=1.6e-2, atol=2e-3) if autocast else {}
    for g, e in zip(torch.autograd.grad(got, (hidden, weight)), torch.autograd.grad(expected, (hidden, weight))):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, **tolerance)


def test_cross_entropy_refuses_a_second_backward():
    """The backward writes the gradient over the saved logits, so running it twice must fail, not mislead."""
    hidden = torch.randn(4, 8, requires_grad=True)
    loss = chunked_cross_entropy(hidden, torch.randn(10, 8), torch.randint(0, 10, (4,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_correction_bias_stays_fp32_when_model_is_cast():
    model = random_model(tiny_config())
    before = [r.e_score_correction_bias.clone() for r in model.routers()]
    model.to(torch.bfloat16)
    for router, bias in zip(model.routers(), before):
        assert router.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(router.e_score_correction_bias, bias)
        assert router.weight.dtype == torch.bfloat16
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in model.state_dict()


def test_meta_device_build_then_init_gives_a_working_model():
    config = tiny_config()
    with torch.device("meta"):
        model = GLM46ForCausalLM(config)
    model.to_empty(device="cpu")
    model.init_weights()
    reference = GLM46ForCausalLM(config)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert abs(model.lm_head.weight.std().item() - config.initializer_range) < 0.01
    assert torch.isfinite(model(torch.zeros(1, 4, dtype=torch.long)).logits).all()


def test_partial_rope_leaves_the_second_half_of_each_head_unrotated():
    from glm46.modules.layers import RotaryEmbedding, apply_rotary_pos_emb

    rope = RotaryEmbedding(rotary_dim=16, theta=10000.0)
    x = torch.randn(1, 2, 5, 32)
    cos, sin = rope(torch.arange(5)[None] + 3, torch.float32)
    y = apply_rotary_pos_emb(x, cos, sin)
    assert torch.equal(y[..., 16:], x[..., 16:])
    torch.testing.assert_close(y[..., :16].norm(dim=-1), x[..., :16].norm(dim=-1))
    torch.testing.assert_close(rope.inv_freq, 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16))


def test_packed_documents_do_not_attend_across_boundaries():
    model = random_model(tiny_config())
    a = torch.randint(0, 160, (1, 7), generator=torch.Generator().manual_seed(5))
    b = torch.randint(0, 160, (1, 9), generator=torch.Generator().manual_seed(6))
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(7), torch.arange(9)])[None]
    with torch.no_grad():
        together = model(packed, position_ids=positions).logits
        torch.testing.assert_close(together[:, :7], model(a).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(together[:, 7:], model(b).logits, rtol=1e-5, atol=1e-5)
        unmasked = model(packed, position_ids=torch.arange(16)[None]).logits
    assert not torch.allclose(unmasked[:, 7:], together[:, 7:], atol=1e-3), "without restarts B would see A"


@pytest.mark.slow
def test_compiled_model_trains_as_eager_on_cpu_fp32():
    """torch.compile over the whole model in fp32 on the CPU: the grouped experts run between the compiled graphs
    (F.grouped_mm's meta kernel takes bf16 only in torch 2.13, which used to fail the trace); loss and
    gradients equal eager's."""
    torch.manual_seed(0)
    model = GLM46ForCausalLM(tiny_config(num_nextn_predict_layers=1))
    x = torch.randint(0, model.config.vocab_size, (2, 16))

    def loss_and_grads(m):
        out = m(x, labels=x.roll(-1, dims=1))
        loss = out.loss + out.mtp_loss
        return loss, torch.autograd.grad(loss, list(model.parameters()))

    eager_loss, eager_grads = loss_and_grads(model)
    compiled_loss, compiled_grads = loss_and_grads(torch.compile(model))
    torch.testing.assert_close(compiled_loss, eager_loss)
    for got, expected in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
