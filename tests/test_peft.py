"""LoRA and DoRA (glm46.peft) against the peft library on transformers' Glm4MoeForCausalLM, the merge, the frozen base
and the adapter files in peft's format."""

import pytest
import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora import Linear as PeftLinear
from torch import nn
from transformers import AutoModelForCausalLM

from glm46.hf import save_hf
from glm46.peft import (
    AdapterSettings,
    ExpertAdapter,
    adapted_weights,
    adapter_parameters,
    adapters_disabled,
    add_adapters,
    reset_adapters,
)
from glm46.peft.merge import merge_and_unload
from glm46.peft.peft_format import load_adapter, save_adapter, unsupported
from glm46.peft.token_rows import TokenRows, TokenRowsWeight, token_indices

from .helpers import random_model, relative_error, tiny_config

TOLERANCE = 1e-6  # fp32 relative logits error against peft (the same operations in the same order)
MERGED_TOLERANCE = 1e-5  # a merged weight rounds W + s B A once, then multiplies: measured up to 1.6e-6
ALL = ["attention", "dense_mlp", "shared_experts", "experts"]
TOKEN_IDS = [3, 7, 11]  # the rows a case with peft.trainable_tokens trains (its names are resolved in a run)


def config():
    return tiny_config(n_shared_experts=1, num_hidden_layers=2, use_qk_norm=True, attention_bias=True)


def random_adapters(model: nn.Module, seed: int) -> None:
    """Non-zero B (and magnitudes away from the base norms): an adapter that changes nothing hides every mismatch."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, adapter, weight in adapted_weights(model):
            if isinstance(adapter, TokenRows):
                adapter.trainable_tokens_delta.copy_(torch.randn(adapter.trainable_tokens_delta.shape) * 0.5)
                continue
            adapter.lora_A.copy_(torch.randn(adapter.lora_A.shape, generator=generator) * 0.3)
            adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape, generator=generator) * 0.3)
            if adapter.lora_magnitude_vector is not None:
                adapter.reset_magnitude(weight)
                adapter.lora_magnitude_vector.mul_(1 + 0.2 * torch.rand(adapter.lora_magnitude_vector.shape))


def adapted_model(settings: AdapterSettings, seed: int = 0):
    model = random_model(config(), seed)
    add_adapters(model, settings, TOKEN_IDS if settings.trainable_tokens else None)
    random_adapters(model, seed + 1)
    return model.eval()


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(5))


CASES = {
    "lora_per_expert": AdapterSettings(targets=ALL),
    "lora_shared": AdapterSettings(targets=ALL, experts="shared"),
    "dora_attention": AdapterSettings(method="dora", targets=["attention"]),
    "lora_attention_dropout": AdapterSettings(targets=["q_proj", "v_proj"], dropout=0.1, r=4, alpha=32),
    "lora_token_rows": AdapterSettings(targets=ALL, trainable_tokens=["special"]),
}


@pytest.mark.parametrize("case", CASES)
def test_adapters_load_in_peft_on_transformers_with_our_logits(case, tmp_path):
    settings = CASES[case]
    base = random_model(config(), 0)
    save_hf(base, tmp_path / "base")
    model = adapted_model(settings)
    model.load_state_dict(base.state_dict(), strict=False)  # the same base under the adapters
    save_adapter(model, settings, tmp_path / "adapter")

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    x = tokens(model.config.vocab_size)
    with torch.no_grad():
        ours, theirs = model(x).logits, peft_model(input_ids=x).logits
    assert relative_error(ours, theirs) < TOLERANCE
    with torch.no_grad(), adapters_disabled(model), peft_model.disable_adapter():
        assert relative_error(model(x).logits, peft_model(input_ids=x).logits) < TOLERANCE
    assert relative_error(ours, base(x).logits) > 1e-2, "the adapters change nothing: the test would prove nothing"


def test_an_lm_head_trained_whole_beside_embedding_rows_loads_in_peft(tmp_path):
    """peft.targets with lm_head (peft's modules_to_save) and peft.trainable_tokens (rows of the embedding only)."""
    settings = AdapterSettings(targets=["attention", "lm_head"], trainable_tokens=["special"])
    base = random_model(config(), 0)
    save_hf(base, tmp_path / "base")
    model = adapted_model(settings)
    assert not isinstance(model.lm_head, TokenRowsWeight) and isinstance(model.model.embed_tokens, TokenRowsWeight)
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn(model.lm_head.weight.shape) * 0.1)
    save_adapter(model, settings, tmp_path / "adapter")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    x = torch.tensor([[3, 5, 7, 9, 11, 2, 3, 7]])
    with torch.no_grad():
        assert relative_error(model(x).logits, peft_model(input_ids=x).logits) < TOLERANCE
    fresh = random_model(config(), 0)
    add_adapters(fresh, settings, TOKEN_IDS)
    load_adapter(fresh, settings, tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, model(x).logits)


@pytest.mark.parametrize("shared", [False, True], ids=["per_expert", "shared"])
def test_dora_on_experts_is_peft_dora_on_each_expert(shared):
    """peft's parameter targets have no DoRA: peft's DoRA on each expert's weight as an nn.Linear is the reference."""
    torch.manual_seed(0)
    experts, out_features, in_features, rank = 4, 6, 8, 2
    weight = torch.randn(experts, out_features, in_features)
    adapter = ExpertAdapter(weight.shape, rank, alpha=4, shared=shared, dora=True)
    with torch.no_grad():
        adapter.lora_A.normal_(0, 0.3)
        adapter.lora_B.normal_(0, 0.3)
        adapter.reset_magnitude(weight)
        adapter.lora_magnitude_vector.mul_(1 + 0.2 * torch.rand(experts, out_features))
    counts = torch.tensor([3, 0, 2, 4])
    x = torch.randn(int(counts.sum()), in_features)
    ours = adapter.linear(x, weight, counts)

    expected = []
    for e, rows in enumerate(x.split(counts.tolist())):
        linear = nn.Linear(in_features, out_features, bias=False)
        linear.weight.data.copy_(weight[e])
        config = LoraConfig(r=rank, lora_alpha=4, use_dora=True)
        reference = PeftLinear(linear, "default", r=rank, lora_alpha=4, use_dora=True, config=config)
        with torch.no_grad():
            reference.lora_A["default"].weight.copy_(adapter.lora_A if shared else adapter.lora_A[e])
            reference.lora_B["default"].weight.copy_(adapter.lora_B if shared else adapter.lora_B[e])
            reference.lora_magnitude_vector["default"].weight.copy_(adapter.lora_magnitude_vector[e])
        expected.append(reference(rows))
    assert relative_error(ours, torch.cat(expected)) < TOLERANCE


MERGES = {
    "lora_per_expert": AdapterSettings(targets=ALL),
    "lora_shared": AdapterSettings(targets=ALL, experts="shared"),
    "dora_per_expert": AdapterSettings(method="dora", targets=ALL),
    "dora_shared": AdapterSettings(method="dora", targets=ALL, experts="shared"),
    "lora_token_rows": CASES["lora_token_rows"],
}


@pytest.mark.parametrize("case", MERGES)
def test_merged_model_gives_the_adapted_logits(case, tmp_path):
    model = adapted_model(MERGES[case])
    x = tokens(model.config.vocab_size)
    with torch.no_grad():
        adapted = model(x).logits
        merged = merge_and_unload(model)
        assert not adapter_parameters(merged) and not list(adapted_weights(merged))
        assert relative_error(merged(x).logits, adapted) < MERGED_TOLERANCE
    save_hf(merged, tmp_path)  # a plain model again: every exporter reads it


def test_only_the_adapters_train_and_the_base_stays_bit_identical():
    settings = AdapterSettings(method="dora", targets=ALL)
    model = random_model(config(), 0)
    add_adapters(model, settings)
    base = {name: t.clone() for name, t in model.state_dict().items() if ".adapter." not in name}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in adapter_parameters(model).values()}
    reset_adapters(model, seed=0)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    x = tokens(model.config.vocab_size)
    for _ in range(3):
        loss = model(x, labels=x.roll(-1, 1)).loss
        loss.backward()
        assert all(p.grad is None for name, p in model.named_parameters() if ".adapter." not in name)
        optimizer.step()
        optimizer.zero_grad()
    after = model.state_dict()
    changed = [name for name, tensor in base.items() if not torch.equal(after[name], tensor)]
    assert changed == []
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in adapter_parameters(model).items() if "lora_B" in n)


def test_token_rows_train_alone_and_every_other_row_stays_bit_identical():
    """peft.trainable_tokens: the rows of those tokens in the embedding and lm_head train (their gradient reaches
    them through the loss's direct read of lm_head.weight); the other rows, and the base tensors, do not move."""
    settings = AdapterSettings(targets=["attention"], trainable_tokens=["special"])
    model = random_model(config(), 0)
    add_adapters(model, settings, TOKEN_IDS)
    reset_adapters(model, seed=0)
    base = {name: t.clone() for name, t in model.state_dict().items() if ".adapter." not in name}
    with torch.no_grad():  # the rows start as the base's: the model is the base
        for layer in (model.model.embed_tokens, model.lm_head):
            assert torch.equal(layer.weight, layer._parameters["weight"])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.tensor([[3, 5, 7, 9, 11, 2, 3, 7]])
    for _ in range(3):
        model(x, labels=x.roll(-1, 1)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in base.items())
    with torch.no_grad():
        for layer in (model.model.embed_tokens, model.lm_head):
            moved = (layer.weight != layer._parameters["weight"]).any(dim=1).nonzero().flatten().tolist()
            assert moved == TOKEN_IDS, f"{type(layer).__name__}: rows {moved} moved"


def test_trainable_tokens_are_found_in_the_tokenizer_by_name(tmp_path):
    import json

    tokenizer = tmp_path / "tokenizer.json"
    added = [{"id": 5, "content": "<|user|>", "special": True}, {"id": 6, "content": "<tool_call>", "special": True}]
    added.append({"id": 7, "content": "plain", "special": False})
    tokenizer.write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}, "added_tokens": added}))
    assert token_indices(["special"], tokenizer) == [5, 6]
    assert token_indices(["b", "plain", "<tool_call>"], tokenizer) == [1, 6, 7]
    with pytest.raises(ValueError, match=r"'<\|nope\|>' is not a token of .*tokenizer.json"):
        token_indices(["<|nope|>"], tokenizer)
    with pytest.raises(ValueError, match="both layers train whole"):
        AdapterSettings(targets=["attention", "embed_tokens", "lm_head"], trainable_tokens=["special"])


def test_adapter_files_round_trip_and_refuse_what_they_do_not_hold(tmp_path):
    settings = AdapterSettings(targets=ALL)
    model = adapted_model(settings)
    save_adapter(model, settings, tmp_path)
    fresh = random_model(config(), 0)
    add_adapters(fresh, settings)
    load_adapter(fresh, settings, tmp_path)
    x = tokens(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, model(x).logits)

    shared = random_model(config(), 0)
    add_adapters(shared, AdapterSettings(targets=ALL, experts="shared"))
    with pytest.raises(ValueError, match="a pair per expert"):
        load_adapter(shared, AdapterSettings(targets=ALL, experts="shared"), tmp_path)
    other_rank = random_model(config(), 0)
    add_adapters(other_rank, AdapterSettings(targets=ALL, r=4))
    with pytest.raises(ValueError, match="peft.r=4"):
        load_adapter(other_rank, AdapterSettings(targets=ALL, r=4), tmp_path)
    rows = CASES["lora_token_rows"]
    save_adapter(adapted_model(rows), rows, tmp_path / "rows")
    other_rows = random_model(config(), 0)
    add_adapters(other_rows, rows, [3, 8])
    with pytest.raises(ValueError, match=r"trainable_token_indices for embed_tokens are \[3, 7, 11\]"):
        load_adapter(other_rows, rows, tmp_path / "rows")
    assert "DoRA" in unsupported(AdapterSettings(method="dora", targets=ALL))
    assert unsupported(AdapterSettings(method="dora", targets=["attention"])) is None


def test_merged_weights_for_a_weight_push_then_the_base_back_bit_for_bit(tmp_path):
    """RL's push to the rollout engine: save_hf inside merged_weights writes the adapted model; after it the base and
    the adapters are as they were, and save_hf outside refuses active adapters."""
    from glm46.hf import load_hf
    from glm46.peft.merge import merged_weights

    model = adapted_model(MERGES["dora_per_expert"])
    before = {name: t.clone() for name, t in model.state_dict().items()}
    x = tokens(model.config.vocab_size)
    with torch.no_grad():
        adapted = model(x).logits
        with merged_weights(model):
            save_hf(model, tmp_path)
        pushed = load_hf(tmp_path)(x).logits
    assert relative_error(pushed, adapted) < MERGED_TOLERANCE
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in before.items())
    with pytest.raises(ValueError, match="fold the adapters in"):
        save_hf(model, tmp_path / "again")
