"""Muon against torch.optim.Muon and torch.optim.AdamW, per-expert batching, grouping, state round trip."""

import copy

import pytest
import torch

from glm46.optim import Muon, muon_param_groups

from .helpers import random_model, tiny_config

SETTINGS = dict(lr=0.02, weight_decay=0.1)


def run_steps(optimizer, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()


@pytest.mark.parametrize("shape", [(32, 48), (48, 32), (64, 64)])
def test_2d_update_equals_torch_muon_match_rms_adamw(shape):
    """Same bf16 Newton-Schulz as torch.optim.Muon, so equal to rounding."""
    torch.manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(shape))
    theirs = torch.nn.Parameter(ours.detach().clone())
    grads = [[torch.randn(shape)] for _ in range(4)]
    run_steps(Muon([{"params": [ours], "use_muon": True}], ns_dtype=torch.bfloat16, **SETTINGS), [ours], grads)
    run_steps(torch.optim.Muon([theirs], adjust_lr_fn="match_rms_adamw", **SETTINGS), [theirs], grads)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_stacked_experts_equal_one_matrix_at_a_time():
    torch.manual_seed(1)
    stacked = torch.nn.Parameter(torch.randn(4, 24, 40))
    singles = [torch.nn.Parameter(m.detach().clone()) for m in stacked]
    grads = [torch.randn(4, 24, 40) for _ in range(3)]
    run_steps(Muon([{"params": [stacked], "use_muon": True}], **SETTINGS), [stacked], [[g] for g in grads])
    run_steps(Muon([{"params": singles, "use_muon": True}], **SETTINGS), singles, [list(g) for g in grads])
    torch.testing.assert_close(stacked.detach(), torch.stack([s.detach() for s in singles]), rtol=0, atol=1e-6)


def test_fused_gate_up_is_orthogonalised_as_separate_gate_and_up():
    torch.manual_seed(2)
    fused = torch.nn.Parameter(torch.randn(3, 2 * 16, 40))  # [E, 2I, H]
    gates = [torch.nn.Parameter(m[:16].detach().clone()) for m in fused]
    ups = [torch.nn.Parameter(m[16:].detach().clone()) for m in fused]
    grads = [torch.randn(3, 32, 40) for _ in range(3)]
    run_steps(Muon([{"params": [fused], "use_muon": True, "row_chunks": 2}], **SETTINGS), [fused], [[g] for g in grads])
    run_steps(
        Muon([{"params": gates + ups, "use_muon": True}], **SETTINGS),
        gates + ups,
        [[*(x[:16] for x in g), *(x[16:] for x in g)] for g in grads],
    )
    expected = torch.stack([torch.cat([g.detach(), u.detach()]) for g, u in zip(gates, ups)])
    torch.testing.assert_close(fused.detach(), expected, rtol=0, atol=1e-6)


def test_update_rms_is_0_2_for_a_fresh_matrix():
    p = torch.nn.Parameter(torch.zeros(64, 256))
    p.grad = torch.randn(64, 256)
    Muon([{"params": [p], "use_muon": True}], lr=1.0, weight_decay=0.0, ns_dtype=torch.float32).step()
    rms = p.detach().pow(2).mean().sqrt().item()
    assert 0.12 < rms < 0.28  # Newton-Schulz gives singular values in ~(0.5, 1.5), so RMS ~ 0.2


def test_adamw_groups_equal_torch_adamw():
    torch.manual_seed(3)
    ours = [torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(5, 3))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    grads = [[torch.randn(10), torch.randn(5, 3)] for _ in range(5)]
    settings = dict(lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    run_steps(Muon([{"params": ours, "use_muon": False}], **settings), ours, grads)
    run_steps(torch.optim.AdamW(theirs, fused=True, **settings), theirs, grads)  # the kernel the groups run
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_glm45_grouping_rule():
    model = random_model(tiny_config())
    groups = muon_param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    by_group = [{names[id(p)] for p in g["params"]} for g in groups]
    muon, fused, adamw = by_group
    assert [g["use_muon"] for g in groups] == [True, True, False] and groups[1]["row_chunks"] == 2
    assert {
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.q_norm.weight",
    } <= adamw
    assert {
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.experts.down_proj",
        "model.layers.0.self_attn.q_proj.weight",
        "mtp_layers.0.eh_proj.weight",
    } <= muon
    assert fused == {
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.2.mlp.experts.gate_up_proj",
        "mtp_layers.0.block.mlp.experts.gate_up_proj",
    }
    assert sum(len(g) for g in by_group) == len(names)


def test_state_dict_round_trip_continues_identically():
    model = random_model(tiny_config())
    x = torch.randint(0, 160, (2, 8))

    def step(m, opt):
        opt.zero_grad()
        out = m(x, labels=x)
        (out.loss + out.mtp_loss).backward()
        opt.step()

    optimizer = Muon(muon_param_groups(model), lr=0.01)
    for _ in range(2):
        step(model, optimizer)
    clone = copy.deepcopy(model)
    restored = Muon(muon_param_groups(clone), lr=0.01)
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for _ in range(2):
        step(model, optimizer)
        step(clone, restored)
    for a, b in zip(model.parameters(), clone.parameters()):
        assert torch.equal(a, b)


def test_muon_refuses_a_vector_in_a_muon_group():
    with pytest.raises(ValueError, match=r"\(10,\)"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(10))], "use_muon": True}])


def test_batched_newton_schulz_is_bounded_in_bytes_and_equals_one_update_at_a_time(monkeypatch):
    """Same-shape updates share batched calls of at most max_bytes (here two 8x8 fp32 matrices, 512 bytes); each
    result is that of its update orthogonalised alone, whatever batch it landed in."""
    from glm46.optim import newton_schulz
    from glm46.optim.newton_schulz import NewtonSchulz, orthogonalize, orthogonalize_batched, orthogonalize_stacks

    generator = torch.Generator().manual_seed(0)
    updates = [torch.randn(shape, generator=generator) for shape in [(8, 8), (8, 8), (2, 8, 8), (8, 8), (4, 8)]]
    spec = NewtonSchulz(steps=5, dtype=torch.float32)
    calls = []

    def record(stacks, *args):
        out = orthogonalize_stacks(stacks, *args)
        calls.append(tuple(out.shape))
        return out

    monkeypatch.setattr(newton_schulz, "orthogonalize_stacks", record)
    results = orthogonalize_batched(updates, [spec] * len(updates), max_bytes=512)
    assert calls == [(2, 8, 8), (2, 8, 8), (1, 8, 8), (1, 4, 8)]  # 8x8: [0, 1], [2], [3]; then the 4x8
    for update, result in zip(updates, results):
        torch.testing.assert_close(result, orthogonalize(update, 5, torch.float32))


def test_muon_takes_its_newton_schulz_batch_from_ns_batch_bytes(monkeypatch):
    """optim.ns_batch_bytes reaches the batched calls: four 8x8 matrices go in one call by default, in pairs at 512
    bytes, with the same update either way."""
    from glm46.optim import newton_schulz

    calls = []
    original = newton_schulz.orthogonalize_stacks

    def record(stacks, *args):
        calls.append(sum(len(s) for s in stacks))
        return original(stacks, *args)

    monkeypatch.setattr(newton_schulz, "orthogonalize_stacks", record)
    grads = [[torch.randn(8, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]]
    results = []
    for batch_bytes in (newton_schulz.BATCH_BYTES, 512):
        params = [torch.nn.Parameter(torch.eye(8)) for _ in range(4)]
        muon = Muon([{"params": params, "use_muon": True}], ns_dtype=torch.float32, ns_batch_bytes=batch_bytes)
        calls.clear()
        run_steps(muon, params, grads)
        results.append((list(calls), [p.detach().clone() for p in params]))
    assert results[0][0] == [4] and results[1][0] == [2, 2]
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
