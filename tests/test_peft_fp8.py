"""`peft.base_dtype=fp8`: the frozen base's decoder matrices stay in block FP8 (one byte each), dequantized per use.

Against the reference, the same adapters on a bf16 base holding the dequantized weights: the logits, the adapters'
gradients and the merged export are bit for bit the same. A block-FP8 checkpoint is read bit for bit, a bf16 one
quantized as task=export's FP8 copy quantizes it, and the base never changes in training."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glm46.checkpoint.fp8 import export_fp8
from glm46.checkpoint.hub_files import SINGLE_FILE
from glm46.hf import load_hf, save_hf
from glm46.modules.block_fp8 import FP8, SCALE_SUFFIX
from glm46.peft import AdapterSettings, add_adapters, reset_adapters
from glm46.peft.fp8_base import Fp8Linear, stored_in_fp8
from glm46.peft.merge import merge_and_unload, merged_weights

from .helpers import random_model, tiny_config

BLOCK = 32  # not a divisor of the matrices' sides (48, 64, 96, 128): partial blocks, also inside each expert part
CONFIG = tiny_config(moe_intermediate_size=48)
TARGETS = ["attention", "dense_mlp", "shared_experts", "experts"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A bf16 HF folder and its block-FP8 copy (task=export's, as zai-org's -FP8 repositories lay it out)."""
    root = tmp_path_factory.mktemp("fp8_base")
    bf16 = save_hf(random_model(CONFIG, seed=0), root / "bf16")
    return {"bf16": bf16, "fp8": export_fp8(bf16, root / "fp8", BLOCK)}


def adapted(checkpoint: Path, method: str, base_dtype: str):
    """The adapters of `method` on `checkpoint`, B drawn (not zero) so the adapters act."""
    model = random_model(CONFIG, seed=1)
    add_adapters(model, AdapterSettings(method=method, r=4, targets=TARGETS, base_dtype=base_dtype), fp8_block=BLOCK)
    load_hf(checkpoint, model=model)
    reset_adapters(model, seed=0)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def loss_and_grads(model, ids):
    with torch.autocast("cpu", torch.bfloat16):
        logits = model(ids).logits
    logits.float().square().mean().backward()
    return logits, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_an_fp8_base_computes_as_the_bf16_base_of_its_dequantized_weights(checkpoints, method, tmp_path):
    fp8 = adapted(checkpoints["fp8"], method, "fp8")
    reference = adapted(checkpoints["fp8"], method, "bfloat16")  # read dequantized into bf16
    assert isinstance(fp8.model.layers["0"].self_attn.q_proj, Fp8Linear)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits, grads = loss_and_grads(fp8, ids)
    expected_logits, expected_grads = loss_and_grads(reference, ids)
    assert torch.equal(logits, expected_logits)
    assert grads.keys() == expected_grads.keys() and len(grads) > 20
    for name, grad in grads.items():
        assert torch.equal(grad, expected_grads[name]), name
    # RL's weight push (merged for the length of the block, the FP8 base back after it) and the merged export (bf16):
    # the same files
    before = {n: t.clone() for n, t in fp8.state_dict().items()}
    with merged_weights(fp8):
        pushed = load_file(save_hf(fp8, tmp_path / "pushed") / SINGLE_FILE)
    after = fp8.state_dict()
    assert after.keys() == before.keys()
    assert all(
        torch.equal(t.view(torch.uint8), after[n].view(torch.uint8)) for n, t in before.items() if t.dtype == FP8
    )
    exports = [save_hf(merge_and_unload(m), tmp_path / tag) for m, tag in ((fp8, "fp8"), (reference, "bf16"))]
    merged, expected = (load_file(folder / SINGLE_FILE) for folder in exports)
    assert merged.keys() == expected.keys() == pushed.keys() and not any(k.endswith(SCALE_SUFFIX) for k in merged)
    for key, tensor in expected.items():
        assert torch.equal(merged[key], tensor) and torch.equal(pushed[key], tensor), key


def test_the_fp8_release_is_read_bit_for_bit_and_a_bf16_one_quantized_as_the_fp8_export(checkpoints):
    release = load_file(checkpoints["fp8"] / SINGLE_FILE)
    from_release = adapted(checkpoints["fp8"], "lora", "fp8")
    from_bf16 = adapted(checkpoints["bf16"], "lora", "fp8")
    names = dict((id(m), n) for n, m in from_release.named_modules())
    checked = 0
    for module, name in stored_in_fp8(from_release):
        path = f"{names[id(module)]}.{name}"
        values, scales = module._parameters[name], module._buffers[name + SCALE_SUFFIX]
        assert values.dtype == FP8
        other = from_bf16.get_submodule(names[id(module)])
        assert torch.equal(values.view(torch.uint8), other._parameters[name].view(torch.uint8)), path
        assert torch.equal(scales, other._buffers[name + SCALE_SUFFIX]), path
        if name == "gate_up_proj":  # expert 3's up matrix: its own blocks, after the gate matrix's
            key = path.replace("experts.gate_up_proj", "experts.3.up_proj.weight")
            rows = CONFIG.moe_intermediate_size
            assert torch.equal(values[3, rows:].view(torch.uint8), release[key].view(torch.uint8))
            assert torch.equal(scales[3, 2:], release[key + SCALE_SUFFIX])  # 48 rows: 2 blocks of 32
        elif name == "weight":
            assert torch.equal(values.view(torch.uint8), release[path].view(torch.uint8)), path  # the Hub's name
            assert torch.equal(scales, release[path + SCALE_SUFFIX]), path
        checked += 1
    assert checked == 3 * 4 + 3 + 2 * (3 + 2)  # attention x 3 layers, the dense MLP, 2 MoE layers' shared + experts


def test_training_leaves_the_fp8_base_as_read_and_keeps_no_dequantized_weight_for_the_backward(checkpoints):
    model = adapted(checkpoints["fp8"], "lora", "fp8")
    base = {n: t.clone() for n, t in model.state_dict().items() if ".adapter." not in n}
    assert sum(1 for t in base.values() if t.dtype == FP8) == 3 * 4 + 3 + 2 * (3 + 2)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    # 21 tokens: no activation has a weight's shape (32 tokens' 64 expert rows would: [64, 48])
    ids = torch.randint(0, CONFIG.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_and_grads(model, ids)
        optimizer.step()
        optimizer.zero_grad()
    for name, tensor in model.state_dict().items():
        if name in base:
            same = torch.equal(tensor.view(torch.uint8), base[name].view(torch.uint8)) if tensor.dtype == FP8 else None
            assert same if same is not None else torch.equal(tensor, base[name]), name
    # what autograd kept of the quantized weights: their FP8 values (the parameters themselves), never a dequantized
    # copy (the MTP layers' bf16 weights, of the same shapes, are kept as they are: parameters too)
    # (or a transposed view of one: shapes compared as sorted sides)
    fp8_shapes = {tuple(sorted(t.shape)) for t in base.values() if t.dtype == FP8}
    parameters = {p.data_ptr() for p in model.parameters()}
    assert any(t.dtype == FP8 for t in saved)
    copies = [
        (t.shape, t.dtype) for t in saved if tuple(sorted(t.shape)) in fp8_shapes and t.data_ptr() not in parameters
    ]
    assert not copies, f"dequantized weights kept for the backward: {copies}"
