"""Adapters under the layouts: expert parallelism (each rank its own experts' pairs) and FSDP2 on 2 processes train
them as one process does, and leave every base tensor as init_from gave it (tests.test_parallel's harness)."""

import json
import shutil

import pytest
import torch

from glm46.peft import is_adapter_name

from .test_parallel import assert_same_run, initial_weights, run_layout  # noqa: F401 - the fixture

# DoRA: the magnitudes are norms over sharded rows too; the rows of 3 tokens of the embedding and the lm_head (split
# by FSDP2 over the vocabulary, on the first and last pipeline stages) train beside the adapters
PEFT = {"method": "dora", "r": 4, "alpha": 8, "lr": 1e-2, "trainable_tokens": ["special"]}


@pytest.fixture(scope="module")
def peft_weights(tmp_path_factory, initial_weights):  # noqa: F811
    """initial_weights with a tokenizer.json naming 3 special tokens (what peft.trainable_tokens reads)."""
    folder = tmp_path_factory.mktemp("peft_weights") / "hf"
    shutil.copytree(initial_weights, folder)
    added = [{"id": i, "content": f"<|special{i}|>", "special": True} for i in (3, 17, 40)]
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {}}, "added_tokens": added}))
    return str(folder)


@pytest.fixture(scope="module")
def single_peft(tmp_path_factory, peft_weights):
    return run_layout(tmp_path_factory.mktemp("single"), "single", init_from=peft_weights, peft=PEFT)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (FP8 tensors, which torch.equal does not compare, by their bytes)."""
    if a.dtype != b.dtype:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype.itemsize == 1 else torch.equal(a, b)


def assert_base_untouched(run: dict) -> None:
    base = [name for name in run["state"] if not is_adapter_name(name)]
    assert base and all(same_bits(run["state"][name], run["initial"][name]) for name in base)
    adapters = [name for name in run["state"] if is_adapter_name(name) and "lora_B" in name]
    assert adapters and all(run["state"][name].abs().sum() > 0 for name in adapters), "the adapters did not train"
    rows = [name for name in run["state"] if name.endswith("trainable_tokens_delta")]
    assert len(rows) == 2 and all(not torch.equal(run["state"][n], run["initial"][n]) for n in rows), "rows frozen"


def test_one_process_trains_the_adapters_alone(single_peft):
    assert_base_untouched(single_peft)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep", "fsdp2", "pp", "fsdp2_ep"])
def test_adapters_on_two_processes_equal_one_process(tmp_path, peft_weights, single_peft, layout):
    run = run_layout(tmp_path, layout, init_from=peft_weights, devices=2, peft=PEFT)
    if layout == "ep":
        assert run["expert_parallel"] == 2, "the experts (and their adapters) must be split over 2 ranks"
    assert_same_run(run, single_peft)
    assert_base_untouched(run)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "devices, overrides", [(2, []), (4, ["parallelism.sequence_parallel=true"])], ids=["tp2", "tp2-fsdp2-sp"]
)
def test_adapters_under_tensor_parallelism_equal_one_process(tmp_path, peft_weights, single_peft, devices, overrides):
    """The adapters split with their weights (B's rows and the magnitudes of a column-parallel layer, A's inputs of a
    row-parallel one; the whole factors' gradients all-reduced), alone and under FSDP2 with sequence parallelism.
    Losses and gradient norms agree to 1e-5 (measured: 1.4e-7). The final weights to 1e-4 (measured: 3.1e-5, against
    FSDP2's 5e-6): the partial sums of the row-parallel outputs and of A's gradient add in another order, and AdamW's
    per-element normalisation carries that rounding into the small factors B trained from zero."""
    run = run_layout(tmp_path, "tp", init_from=peft_weights, devices=devices, peft=PEFT, overrides=overrides)
    assert_same_run(run, single_peft, weight_tolerance=1e-4)
    assert_base_untouched(run)
    for name, tensor in single_peft["merged"].items():  # DoRA's row norms over the row-parallel weights' inputs
        error = (run["merged"][name] - tensor).norm() / tensor.norm()
        assert error <= 1e-5, f"merged {name} differs from the single-process run's by {error:.2e}"


@pytest.fixture(scope="module")
def fp8_weights(tmp_path_factory, peft_weights):
    """peft_weights' block-FP8 copy, in blocks of 24 that cross the shards' edges."""
    from pathlib import Path

    from glm46.checkpoint.fp8 import export_fp8

    return str(export_fp8(Path(peft_weights), tmp_path_factory.mktemp("fp8_weights") / "hf", block=24))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep", "fsdp2"])
def test_an_fp8_base_on_two_processes_trains_as_its_bf16_base(tmp_path, fp8_weights, layout):
    """peft.base_dtype=fp8 (each rank reads its shard's FP8 values and every block's scales) against the same layout
    on a bf16 base read from the same FP8 copy (dequantized): the same losses, gradient norms and adapters, bit for
    bit, under bf16 autocast as both compute; the FP8 base unchanged."""
    runs = {
        dtype: run_layout(
            tmp_path / dtype,
            layout,
            init_from=fp8_weights,
            devices=2,
            peft=PEFT | {"base_dtype": dtype},
            precision="bf16-mixed",
        )
        for dtype in ("fp8", "bfloat16")
    }
    fp8, bf16 = runs["fp8"], runs["bfloat16"]
    assert fp8["losses"] == bf16["losses"] and fp8["grad_norms"] == bf16["grad_norms"]
    adapters = [name for name in bf16["state"] if is_adapter_name(name)]
    assert adapters and all(torch.equal(fp8["state"][name], bf16["state"][name]) for name in adapters)
    assert_base_untouched(fp8)
    stored = [name for name, tensor in fp8["state"].items() if tensor.dtype == torch.float8_e4m3fn]
    assert len(stored) == 3 * 4 + 3 + 2 * (3 + 2)  # attention in 3 layers, the dense MLP, 2 MoE layers' shared + routed
