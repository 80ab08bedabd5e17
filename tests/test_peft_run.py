"""A PEFT run through `python run.py`: from an export, adapters on a frozen base, then the adapter in peft's format
and the merged model; `model=auto` and its refusal; an adapter continued with peft.adapter."""

import json

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from glm46.checkpoint.safe_load import load
from glm46.config.checks import validate
from glm46.config.values import model_config
from glm46.errors import ConfigError
from glm46.hf import load_hf, save_hf

from .helpers import random_model, relative_error, run_py
from .test_parallel import compose_layout

RUN = ["experiment=tiny_bytes", "data.max_bytes=100000", "data.seq_len=32", "data.batch_size=2", "trainer.max_steps=4"]
RUN += [
    "trainer.limit_val_batches=0",
    "callbacks.progress_bar=null",
    "callbacks.throughput=null",
    "eval.after_train=false",
]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """An export of the tiny_bytes model with random weights: what the run fine-tunes."""
    config = model_config(compose_layout("single", ["experiment=tiny_bytes"]))
    return save_hf(random_model(config, seed=0), tmp_path_factory.mktemp("base") / "hf")


@pytest.fixture(scope="module")
def lora_run(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    run_py(*RUN, "model=auto", f"init_from={base}", "peft=lora", "peft.lr=1e-2", f"hydra.run.dir={out}")
    return out


def test_the_run_writes_a_peft_adapter_whose_logits_are_the_merged_exports(lora_run, base):
    config = json.loads((lora_run / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == str(base)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), lora_run / "adapter").eval()
    merged = load_hf(lora_run / "hf").eval()
    x = torch.randint(0, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs, before = merged(x).logits, peft_model(input_ids=x).logits, load_hf(base)(x).logits
    assert relative_error(ours, theirs) < 1e-5
    assert relative_error(ours, before) > 1e-4, "the adapters did not train"


def test_the_merged_export_keeps_its_mtp_layer_and_says_so(lora_run):
    config = json.loads((lora_run / "hf" / "config.json").read_text())
    layer = config["num_hidden_layers"]
    with safe_open(lora_run / "hf" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert config["num_nextn_predict_layers"] == 1 and f"model.layers.{layer}.eh_proj.weight" in keys
    assert not any("adapter" in key for key in keys)


def test_every_frozen_tensor_and_the_routing_biases_are_bit_identical_after_training(lora_run, base):
    state = load(lora_run / "checkpoints" / "last.ckpt", map_location="cpu")["state_dict"]
    start = load_hf(base).state_dict()
    frozen = {name.removeprefix("model."): t for name, t in state.items() if ".adapter." not in name}
    assert frozen.keys() == start.keys()
    assert [name for name, t in frozen.items() if not torch.equal(t, start[name])] == []
    assert any(name.endswith("e_score_correction_bias") for name in frozen)


def test_an_adapter_continued_with_peft_adapter_starts_where_it_ended(lora_run, base, tmp_path):
    """One step at an LR that moves nothing (1e-30 against adapter entries of ~1e-2): the export is the first run's."""
    run_py(*RUN, "model=auto", f"init_from={base}", "peft=lora", f"peft.adapter={lora_run / 'adapter'}",
           "trainer.max_steps=1", "peft.lr=1e-30", f"hydra.run.dir={tmp_path}")  # fmt: skip
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        continued, ended = load_hf(tmp_path / "hf")(x).logits, load_hf(lora_run / "hf")(x).logits
        fresh = load_hf(base)(x).logits
    assert relative_error(continued, ended) < 1e-6 < relative_error(fresh, ended)


def test_model_auto_takes_init_froms_architecture_and_a_named_model_that_differs_is_refused(compose_config, base):
    cfg = compose_config("experiment=tiny_bytes", "model=auto", f"init_from={base}", "model.use_qk_norm=false")
    with pytest.raises(ConfigError, match="use_qk_norm: True there, False here: use model=auto"):
        validate(cfg)
    auto = compose_config("experiment=tiny_bytes", "model=auto", f"init_from={base}")
    assert model_config(auto) == load_hf(base).config
    with pytest.raises(ConfigError, match="model=auto takes the architecture from init_from's config.json"):
        validate(compose_config("experiment=tiny_bytes", "model=auto"))


@pytest.fixture(scope="module")
def fp8_base(base, tmp_path_factory):
    """The base's block-FP8 copy (task=export's), in blocks of 16."""
    from glm46.checkpoint.fp8 import export_fp8

    return export_fp8(base, tmp_path_factory.mktemp("fp8") / "hf", block=16)


def test_an_fp8_base_run_writes_what_its_bf16_base_run_writes(fp8_base, tmp_path):
    """peft.base_dtype=fp8 from a block-FP8 checkpoint against peft.base_dtype=bfloat16 from the same checkpoint read
    dequantized: the same adapter and the same merged export (bf16), bit for bit."""
    outputs = {}
    for dtype in ("fp8", "bfloat16"):
        out = outputs[dtype] = tmp_path / dtype
        run_py(
            *RUN, "model=auto", f"init_from={fp8_base}", "peft=lora", "peft.lr=1e-2", f"peft.base_dtype={dtype}",
            "trainer.precision=bf16-mixed", f"hydra.run.dir={out}",
        )  # fmt: skip
    for name in ("adapter/adapter_model.safetensors", "hf/model.safetensors"):
        with safe_open(outputs["fp8"] / name, "pt") as fp8, safe_open(outputs["bfloat16"] / name, "pt") as bf16:
            assert set(fp8.keys()) == set(bf16.keys()) and not any(k.endswith("_scale_inv") for k in fp8.keys())
            for key in bf16.keys():
                assert torch.equal(fp8.get_tensor(key), bf16.get_tensor(key)), f"{name}: {key}"
    assert json.loads((outputs["fp8"] / "hf/config.json").read_text()).get("quantization_config") is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.precision=32-true"], r"peft.base_dtype=fp8 with trainer.precision=32-true: a fp8 base computes"),
        (["parallelism=tp", "cluster.devices=2"], r"peft.base_dtype=fp8 under parallelism.tensor_parallel=2"),
        (["init_from=null", "model=tiny"], r"peft.base_dtype=fp8 with init_from=None: the FP8 base is read"),
    ],
    ids=["fp32-precision", "tensor-parallel", "no-init-from"],
)
def test_an_fp8_base_that_cannot_run_is_refused_at_composition(compose_config, fp8_base, overrides, message):
    good = ["experiment=tiny_bytes", "model=auto", f"init_from={fp8_base}", "peft=lora", "peft.base_dtype=fp8"]
    validate(compose_config(*good, "trainer.precision=bf16-mixed"))
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(*good, "trainer.precision=bf16-mixed", *overrides))
