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


def assert_base_untouched(run: dict) -> None:
    base = [name for name in run["state"] if not is_adapter_name(name)]
    assert base and all(torch.equal(run["state"][name], run["initial"][name]) for name in base)
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
