"""MTP against transformers' MtpLayer/MtpModel semantics, and MTP weights through save_hf/load_hf."""

import logging

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import MtpModel

from glm46.hf import load_hf, save_hf
from glm46.modules.loss import IGNORE_INDEX

from .helpers import random_model, relative_error, tiny_config


def hf_mtp_logits(hf, mtp: MtpModel, x: torch.Tensor) -> list[torch.Tensor]:
    """Each MTP depth of transformers' MtpModel over a whole sequence, fed as our model feeds it."""
    positions = torch.arange(x.shape[1]).unsqueeze(0).expand_as(x)
    hidden = hf.model(x).last_hidden_state  # after the final norm, as MtpModel is fed
    logits = []
    for k in range(len(mtp.layers)):
        hidden = mtp.forward_layer(k, hidden, positions + k + 1, None, input_ids=x.roll(-(k + 1), dims=1))
        logits.append(mtp._project_to_logits(hidden))
    return logits


def copy_mtp_weights(ours, mtp: MtpModel) -> None:
    for our_layer, hf_layer in zip(ours.mtp_layers, mtp.layers):
        hf_layer.mtp_block.load_state_dict(our_layer.block.state_dict())
        for name in ("enorm", "hnorm", "eh_proj"):
            getattr(hf_layer, name).load_state_dict(getattr(our_layer, name).state_dict())
        hf_layer.post_norm.load_state_dict(our_layer.norm.state_dict())


def test_mtp_matches_transformers_mtp_layer(tmp_path):
    config = tiny_config(num_nextn_predict_layers=2)
    ours = random_model(config)
    save_hf(ours, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    mtp = MtpModel(hf, num_mtp_layers=2).eval()
    copy_mtp_weights(ours, mtp)

    x = torch.randint(0, config.vocab_size, (2, 15), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_mtp_logits(hf, mtp, x)
        got = ours(x).mtp_logits
    assert len(got) == 2
    for k in range(2):
        assert got[k].shape == expected[k].shape == (2, 15, config.vocab_size)
        assert relative_error(got[k], expected[k]) <= 1e-4


def test_checkpoint_mtp_layer_loads_in_transformers_mtp_model(tmp_path):
    """With 46 layers (GLM-4.5-Air's MTP index), transformers' own MTP loader reads our checkpoint's MTP layer."""
    config = tiny_config(
        num_hidden_layers=46,
        hidden_size=32,
        head_dim=16,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    ours = random_model(config)
    save_hf(ours, tmp_path, max_shard_bytes=500_000)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    mtp = MtpModel.from_pretrained(hf).eval()  # raises if any MTP weight is missing

    x = torch.randint(0, config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert relative_error(ours(x).mtp_logits[0], hf_mtp_logits(hf, mtp, x)[0]) <= 1e-4


def test_mtp_weights_survive_round_trip(tmp_path):
    ours = random_model(tiny_config(num_nextn_predict_layers=2))
    save_hf(ours, tmp_path, max_shard_bytes=200_000)
    loaded = load_hf(tmp_path)
    theirs = loaded.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    assert any(name.startswith("mtp_layers.1.block.mlp.experts") for name in theirs)


def test_glm45_duplicate_mtp_embedding_and_head_are_ignored(tmp_path):
    config = tiny_config()
    ours = random_model(config)
    save_hf(ours, tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    L = config.num_hidden_layers
    tensors[f"model.layers.{L}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"model.layers.{L}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, file)
    x = torch.randint(0, config.vocab_size, (1, 7))
    with torch.no_grad():
        assert torch.equal(load_hf(tmp_path)(x).mtp_logits[0], ours(x).mtp_logits[0])


def test_checkpoint_without_mtp_initialises_it_with_a_warning(tmp_path, caplog):
    config = tiny_config()
    save_hf(random_model(config), tmp_path)
    file = tmp_path / "model.safetensors"
    L = config.num_hidden_layers
    save_file({k: v for k, v in load_file(file).items() if not k.startswith(f"model.layers.{L}.")}, file)
    with caplog.at_level(logging.WARNING, logger="glm46.checkpoint.hf_read"):
        model = load_hf(tmp_path)
    assert "MTP layers are initialised afresh" in caplog.text
    eh = model.mtp_layers[0].eh_proj.weight
    assert torch.isfinite(eh).all() and abs(eh.std().item() - config.initializer_range) < 0.02
    assert torch.equal(model.mtp_layers[0].norm.weight, torch.ones(config.hidden_size))


def test_mtp_loss_is_cross_entropy_of_mtp_logits_against_shifted_labels():
    config = tiny_config(num_nextn_predict_layers=2)
    model = random_model(config)
    x = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    labels = x.roll(-1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    with torch.no_grad():
        out = model(x, labels=labels)
        logits = model(x)
    T = x.shape[1]
    expected_main = torch.nn.functional.cross_entropy(logits.logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    expected_mtp = [
        torch.nn.functional.cross_entropy(
            logits.mtp_logits[k - 1][:, : T - 1 - k].flatten(0, 1), x[:, 1 + k :].flatten()
        )
        for k in (1, 2)
    ]
    torch.testing.assert_close(out.loss, expected_main)
    torch.testing.assert_close(out.mtp_loss, torch.stack(expected_mtp).mean())
    assert out.logits is None


def packed_pair(config, lengths=(7, 9)):
    """Two documents in one row as glm46.data.windows packs them: positions restart, no label at a document's
    last token. -> documents [1, L], row [1, T], position_ids [1, T], labels [1, T]."""
    generator = torch.Generator().manual_seed(11)
    documents = [torch.randint(0, config.vocab_size, (1, n), generator=generator) for n in lengths]
    x = torch.cat(documents, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = x.roll(-1, dims=1).masked_fill(positions.roll(-1, dims=1) == 0, IGNORE_INDEX)
    return documents, x, positions, labels


def test_packed_mtp_loss_leaves_out_targets_in_the_next_document():
    """Depth k at position i targets token i+k+1: where that token is in the next document (the last k + 1
    positions of the first document) there is no target, as the main loss has none across the boundary."""
    config = tiny_config(num_nextn_predict_layers=2)
    model = random_model(config)
    _, x, positions, labels = packed_pair(config)
    document = torch.tensor([0] * 7 + [1] * 9)
    T = x.shape[1]
    with torch.no_grad():
        out = model(x, labels=labels, position_ids=positions)
        mtp_logits = model(x, position_ids=positions).mtp_logits
    expected = []
    for k in (1, 2):
        kept = [i for i in range(T - k - 1) if document[i] == document[i + k + 1]]
        assert len(kept) == T - k - 1 - (k + 1)
        logits = mtp_logits[k - 1][0, kept]
        expected.append(F.cross_entropy(logits, x[0, [i + k + 1 for i in kept]]))
    torch.testing.assert_close(out.mtp_loss, torch.stack(expected).mean())


def test_packed_mtp_loss_is_that_of_each_document_alone():
    """Each depth's loss over the packed row is the count-weighted mean of the documents' losses run alone: the
    first document's terms do not see the second's tokens (which its last positions' MTP inputs embed)."""
    config = tiny_config(num_nextn_predict_layers=2)
    model = random_model(config)
    documents, x, positions, labels = packed_pair(config)
    with torch.no_grad():
        packed = model(x, labels=labels, position_ids=positions).mtp_loss
        alone = [model(doc).mtp_logits for doc in documents]
    per_depth = []
    for k in (1, 2):
        sums = [
            F.cross_entropy(logits[k - 1][0, : doc.shape[1] - k - 1], doc[0, k + 1 :], reduction="sum")
            for doc, logits in zip(documents, alone)
        ]
        per_depth.append(sum(sums) / sum(doc.shape[1] - k - 1 for doc in documents))
    torch.testing.assert_close(packed, torch.stack(per_depth).mean())
