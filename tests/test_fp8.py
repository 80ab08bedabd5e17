"""Block-wise FP8 checkpoints (GLM-4.6-FP8's layout: e4m3 weights with `weight_scale_inv`, `quantization_config` in
config.json) are read dequantized, slice by slice; other quantizations are refused naming quantization_config, and
FP8 tensors are never loaded without their scales."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm46.checkpoint.fp8 import dequantize, export_fp8, quantize
from glm46.checkpoint.hub_config import CheckpointError
from glm46.checkpoint.hub_files import SINGLE_FILE
from glm46.hf import load_hf, save_hf

from . import forked
from .helpers import random_model, relative_error, tiny_config

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 128
# Larger than one block in every quantized matrix, and not a multiple of it: partial blocks at the edges.
CONFIG = dict(hidden_size=160, intermediate_size=272, moe_intermediate_size=144, num_attention_heads=6)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
LEFT_IN_BF16 = ("embed_tokens", "lm_head", "mlp.gate.weight", "eh_proj")  # as GLM-4.6-FP8 (and norms, biases)


def reference_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's recipe, one block at a time: scale = amax / 448, value = weight / scale in e4m3."""
    rows, cols = weight.shape
    values = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    for i in range(0, rows, BLOCK):
        for j in range(0, cols, BLOCK):
            tile = weight[i : i + BLOCK, j : j + BLOCK].float()
            scale = tile.abs().max() / 448.0
            scales[i // BLOCK, j // BLOCK] = scale
            values[i : i + BLOCK, j : j + BLOCK] = (tile / scale).to(torch.float8_e4m3fn)
    return values, scales


def reference_dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    out = values.float().clone()
    for i in range(0, out.shape[0], BLOCK):
        for j in range(0, out.shape[1], BLOCK):
            out[i : i + BLOCK, j : j + BLOCK] *= scales[i // BLOCK, j // BLOCK]
    return out


def fp8_copy(export, out) -> dict[str, torch.Tensor]:
    """A block-FP8 copy of an export, as zai-org's -FP8 repositories lay it out; returns the dequantized weights."""
    out.mkdir()
    tensors, dequantized = {}, {}
    for key, tensor in load_file(export / SINGLE_FILE).items():
        if tensor.dim() == 2 and not any(name in key for name in LEFT_IN_BF16):
            values, scales = reference_quantize(tensor)
            tensors[key], tensors[key + "_scale_inv"] = values, scales
            dequantized[key] = reference_dequantize(values, scales)
        else:
            tensors[key] = tensor
    save_file(tensors, out / SINGLE_FILE)
    config = json.loads((export / "config.json").read_text()) | {"quantization_config": FP8_CONFIG}
    (out / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(**CONFIG), seed=0)


@pytest.fixture(scope="module")
def export(model, tmp_path_factory):
    return save_hf(model, tmp_path_factory.mktemp("bf16") / "hf")


def test_a_block_fp8_checkpoint_is_read_dequantized(model, export, tmp_path):
    dequantized = fp8_copy(export, tmp_path / "fp8")
    fp8 = load_hf(tmp_path / "fp8")
    # exactly the dequantized weights, block by block (the experts: one Hub matrix per expert inside our stack)
    reread = {key: t for key, t in load_file(save_hf(fp8, tmp_path / "reread") / SINGLE_FILE).items()}
    assert len(dequantized) > 40
    for key, expected in dequantized.items():
        assert torch.equal(reread[key], expected), key
    # Logits differ from the unquantized model's by FP8's rounding (~2-3% per weight, amplified by this random
    # 3-layer MoE whose routing flips: 34% here, 11% with dense layers only). Reading the FP8 values without their
    # scales (the bug this replaces) put the weights off by a factor of ~1000.
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    with torch.no_grad():
        assert 1e-3 < relative_error(fp8(ids).logits, model(ids).logits) < 0.5


def test_dequantize_reads_any_slice_of_the_blocks():
    """A shard's slice starting inside a block gets the scales of the blocks it overlaps."""
    weight = torch.randn(300, 260)
    values, scales = quantize(weight, BLOCK)
    whole = reference_dequantize(values, scales)
    rows, cols = slice(100, 250), slice(5, 140)
    blocks = scales[
        rows.start // BLOCK : math.ceil(rows.stop / BLOCK), cols.start // BLOCK : math.ceil(cols.stop / BLOCK)
    ]
    assert torch.equal(dequantize(values[rows, cols], blocks, rows, cols, BLOCK), whole[rows, cols])
    assert relative_error(whole, weight) < 0.05


def test_quantize_matches_the_block_by_block_recipe():
    weight = torch.randn(300, 260) * torch.logspace(-3, 1, 260)  # blocks of very different ranges
    values, scales = quantize(weight, BLOCK)
    expected_values, expected_scales = reference_quantize(weight)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(values.float(), expected_values.float())


def test_another_quantization_is_refused_naming_quantization_config(export, tmp_path):
    (tmp_path / "awq").mkdir()
    (tmp_path / "awq" / SINGLE_FILE).write_bytes((export / SINGLE_FILE).read_bytes())
    config = json.loads((export / "config.json").read_text())
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config | {"quantization_config": awq}))
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config .*'awq'.* is not read here"):
        load_hf(tmp_path / "awq")


def test_fp8_weights_without_their_scales_or_config_are_refused(export, tmp_path):
    fp8_copy(export, tmp_path / "fp8")
    tensors = load_file(tmp_path / "fp8" / SINGLE_FILE)
    scale = next(key for key in tensors if key.endswith("_scale_inv"))
    del tensors[scale]
    save_file(tensors, tmp_path / "fp8" / SINGLE_FILE)
    with pytest.raises(CheckpointError, match=f"{scale.removesuffix('_scale_inv')} is FP8 .* without its {scale}"):
        load_hf(tmp_path / "fp8")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="is FP8 .* without a quantization_config in config.json"):
        load_hf(tmp_path / "fp8")


# -------------------------------------------------------------- the FP8 export (task=export export.format=fp8)
# transformers dequantizes an FP8 checkpoint on the CPU only when every matrix is whole blocks: dims of 128s.
BLOCKS = dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_attention_heads=4, head_dim=64)


def run_export(*overrides: str, cwd, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return forked.run(
        [sys.executable, str(ROOT / "run.py"), "task=export", *overrides, f"hydra.run.dir={cwd}/run"],
        capture_output=True, text=True, cwd=cwd, env=os.environ | (env or {}),
    )  # fmt: skip


def test_the_fp8_export_is_glm_fp8_layout_and_transformers_reads_it(tmp_path):
    from transformers import AutoModelForCausalLM

    source = save_hf(random_model(tiny_config(**BLOCKS), seed=0), tmp_path / "hf")
    result = run_export(
        f"export.model={source}", "export.format=fp8", f"export.output={tmp_path / 'fp8'}", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"FP8 export of {source}: 1/1 files (100%)" in result.stdout + result.stderr  # its progress
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"] == FP8_CONFIG and config["torch_dtype"] == "bfloat16"
    written, original = load_file(tmp_path / "fp8" / SINGLE_FILE), load_file(source / SINGLE_FILE)
    for key, tensor in original.items():
        if tensor.dim() == 2 and not key.endswith(("embed_tokens.weight", "lm_head.weight", ".mlp.gate.weight")):
            values, scales = reference_quantize(tensor)  # every matrix but these, block by block
            assert written[key].dtype == torch.float8_e4m3fn and torch.equal(written[key + "_scale_inv"], scales)
            assert torch.equal(written[key].float(), values.float()), key
        else:
            assert written[key].dtype == (torch.float32 if "e_score_correction_bias" in key else torch.bfloat16)
    assert sorted(p.name for p in (tmp_path / "fp8").iterdir()) == sorted(p.name for p in source.iterdir())
    # transformers reads it (dequantizing to bf16 on a CPU): its logits are ours from the same file, to bf16's
    # rounding of the dequantized weights (0.8% measured)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8").float().eval()
    ours = load_hf(tmp_path / "fp8")
    ids = torch.randint(0, 160, (2, 24))
    with torch.no_grad():
        assert relative_error(theirs(ids).logits, ours(ids).logits) < 0.02


def test_the_planned_export_sizes_are_the_files_data(tmp_path):
    """glm46.planning.export_size, which task=estimate prints for the 355B model, counts what the exports write."""
    from glm46.planning.export_size import export_bytes

    config = tiny_config(**CONFIG)  # partial blocks at the edges
    source = save_hf(random_model(config, seed=0).to(torch.bfloat16), tmp_path / "hf")
    export_fp8(source, tmp_path / "fp8")

    def data_bytes(directory) -> int:
        return sum(t.numel() * t.element_size() for t in load_file(directory / SINGLE_FILE).values())

    sizes = export_bytes(config)
    assert (sizes["bf16"], sizes["fp8"]) == (data_bytes(source), data_bytes(tmp_path / "fp8"))


def test_an_export_is_refused_before_it_writes(tmp_path):
    source = save_hf(random_model(tiny_config(), seed=0), tmp_path / "hf")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("mine")
    refusals = {
        "export.model: no model to export": [],
        "export.output: no directory to write": [f"export.model={source}"],
        "holds files: an export writes a new directory, never over one": [
            f"export.model={source}", f"export.output={tmp_path / 'taken'}"
        ],
    }  # fmt: skip
    for message, overrides in refusals.items():
        result = run_export(*overrides, cwd=tmp_path)
        assert result.returncode != 0 and message in result.stderr, (message, result.stderr[-2000:])
        assert "Traceback" not in result.stderr
    assert (tmp_path / "taken" / "file").read_text() == "mine"
