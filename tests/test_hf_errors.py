"""Checkpoints that do not fit the model fail with a message listing the tensors."""

import json

import pytest
from safetensors.torch import load_file, save_file

from glm46.hf import CheckpointError, load_hf, save_hf

from .helpers import random_model, tiny_config


@pytest.fixture
def checkpoint(tmp_path):
    save_hf(random_model(tiny_config()), tmp_path)
    return tmp_path


def test_missing_main_model_tensors_are_listed(checkpoint):
    file = checkpoint / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(CheckpointError) as error:
        load_hf(checkpoint)
    assert "model.layers.0.self_attn.q_proj.weight" in str(error.value)
    assert "model.layers.2.mlp.experts.gate_up_proj" in str(error.value)


def test_misshapen_tensors_are_listed(checkpoint):
    file = checkpoint / "model.safetensors"
    tensors = load_file(file)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10].clone()
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight: checkpoint \(10,\) vs model \(64,\)"):
        load_hf(checkpoint)


def test_missing_files_and_wrong_model_type_are_named(checkpoint, tmp_path_factory):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_hf(checkpoint)
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf(tmp_path_factory.mktemp("empty"))
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type='llama'"):
        load_hf(checkpoint)


def test_the_streaming_writer_refuses_tensors_out_of_order_or_missing(tmp_path):
    import torch

    from glm46.checkpoint.safetensors_writer import StreamingSafetensors

    entries = [("a", (2, 3), torch.float32), ("b", (4,), torch.bfloat16)]
    writer = StreamingSafetensors(tmp_path / "x.safetensors", entries)
    with pytest.raises(RuntimeError, match=r"got b, expected \['a'\]"):
        writer.write("b", torch.zeros(4, dtype=torch.bfloat16))
    writer.write("a", torch.arange(6.0).view(2, 3))
    with pytest.raises(RuntimeError, match="1 tensors never written, first b"):
        writer.close()
    writer = StreamingSafetensors(tmp_path / "y.safetensors", entries)
    writer.write("a", torch.arange(6.0).view(2, 3))
    writer.write("b", torch.tensor([1.5, -2, 0, 3], dtype=torch.bfloat16))
    writer.close()
    written = load_file(tmp_path / "y.safetensors")
    assert torch.equal(written["a"], torch.arange(6.0).view(2, 3))
    assert written["b"].dtype == torch.bfloat16 and written["b"].tolist() == [1.5, -2, 0, 3]
