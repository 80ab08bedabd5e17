"""Batches from prepared shards: deterministic, split across ranks, resumable exactly, fingerprint-checked."""

import json

import lightning as L
import numpy as np
import pytest
import torch

from glm46.data.shards import write_shards
from glm46.data.tokenizer import GLMTokenizer, train_tokenizer
from glm46.data.windows import MixtureWindows
from glm46.lit.shard_data import DataMismatchError, ShardDataModule

from .helpers import RecordBatches, tiny_config
from .test_balancer import lit_module


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("dataset")
    (root / "documents").mkdir()
    rng = np.random.default_rng(0)
    texts = {
        "code": [f"def f{i}(x):\n    return x * {i} + {rng.integers(100)}\n" for i in range(300)],
        "math": [f"Question: What is {a} + {b}?\nAnswer: {a + b}" for a, b in rng.integers(0, 999, (300, 2))],
    }
    for domain, docs in texts.items():
        (root / "documents" / f"{domain}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    tokenizer = GLMTokenizer(train_tokenizer([t for docs in texts.values() for t in docs], vocab_size=320))
    write_shards(root, tokenizer)
    return root


def datamodule(path, **overrides):
    settings = dict(seq_len=32, batch_size=4, mixture={"code": 0.5, "math": 0.5}, seed=7)
    dm = ShardDataModule(str(path), **{**settings, **overrides})
    dm.setup()
    return dm


def first_batches(dm, n=3):
    loader = iter(dm.train_dataloader())
    return [next(loader)["input_ids"] for _ in range(n)]


def test_batches_are_a_function_of_the_seed(dataset):
    a, b = first_batches(datamodule(dataset)), first_batches(datamodule(dataset))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = first_batches(datamodule(dataset, seed=8))
    assert not torch.equal(a[0], c[0])
    batch = next(iter(datamodule(dataset).train_dataloader()))
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    assert batch["input_ids"].shape == (4, 32)


def test_ranks_split_the_stream_without_overlap(dataset):
    dm = datamodule(dataset)
    streams = {d: s.train for d, s in dm.streams.items()}
    single = MixtureWindows(streams, dm.mixture, 32, 7, start=0, rank=0, world_size=1, batch_size=2)
    ranks = [MixtureWindows(streams, dm.mixture, 32, 7, start=0, rank=r, world_size=2, batch_size=2) for r in (0, 1)]
    expected = [row for _, batch in zip(range(4), single) for row in batch["input_ids"]]
    got = [[row for _, batch in zip(range(2), rank) for row in batch["input_ids"]] for rank in ranks]
    interleaved = [x for pair in zip(*got) for x in pair]
    assert len(interleaved) == 8 and all(torch.equal(x, y) for x, y in zip(interleaved, expected))


def test_dataloader_workers_serve_the_same_batches_in_the_same_order(dataset):
    for packing in ("truncate", "best_fit"):
        alone = first_batches(datamodule(dataset, packing=packing, seq_len=64), 5)
        workers = first_batches(datamodule(dataset, packing=packing, seq_len=64, num_workers=2), 5)
        assert all(torch.equal(x, y) for x, y in zip(alone, workers))


def test_mixture_weights_are_followed(dataset):
    dm = datamodule(dataset, mixture={"code": 0.9, "math": 0.1})
    stream = MixtureWindows({d: s.train for d, s in dm.streams.items()}, dm.mixture, 32, 0, 0, 0, 1)
    domains, starts = stream.choose(np.arange(4000))
    assert abs((domains == 0).mean() - 0.9) < 0.02
    assert (starts >= 0).all() and (starts < stream.choices[domains]).all()
    picks, choices = (domains == 0).sum(), stream.choices[0]
    expected = choices * (1 - np.exp(-picks / choices))  # distinct offsets of uniform draws with replacement
    assert len(np.unique(starts[domains == 0])) > 0.95 * expected, "offsets spread uniformly over the domain"


def test_validation_reads_only_held_out_documents(dataset):
    dm = datamodule(dataset, val_fraction=0.1)
    for stream in dm.streams.values():
        assert len(stream.val) > 0 and len(stream.train) > 9 * len(stream.val) * 0.8
    val = list(dm.val_dataloader())
    assert val and all(b["input_ids"].shape[1] == 32 for b in val)


def test_unknown_domain_and_missing_dataset_are_named(dataset, tmp_path):
    with pytest.raises(ValueError, match=r"\['web'\]"):
        datamodule(dataset, mixture={"web": 1.0})
    with pytest.raises(FileNotFoundError, match="task=prepare"):
        datamodule(tmp_path)


def fit(dataset, steps, tmp_path, ckpt_path=None):
    config = tiny_config(vocab_size=320)
    recorder = RecordBatches("input_ids")
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(
        max_steps=steps,
        callbacks=[recorder, checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(lit_module(config), datamodule=datamodule(dataset), ckpt_path=ckpt_path)
    return recorder.batches


def test_resume_continues_at_the_exact_data_position(dataset, tmp_path):
    straight = fit(dataset, 6, tmp_path / "a")
    checkpoint = next((tmp_path / "a").glob("*step=3.ckpt"))
    resumed = fit(dataset, 6, tmp_path / "b", ckpt_path=checkpoint)
    assert len(resumed) == 3 and all(torch.equal(x, y) for x, y in zip(resumed, straight[3:]))
    state = torch.load(checkpoint, weights_only=False)["ShardDataModule"]
    assert state["samples"] == 3 * 4 and state["seed"] == 7


def test_resume_on_other_data_fails_clearly(dataset):
    dm = datamodule(dataset)
    with pytest.raises(DataMismatchError, match="fingerprint"):
        dm.load_state_dict({"phase": "pretrain", "seed": 7, "fingerprint": "0" * 32, "samples": 10})


def test_best_fit_bins_hold_every_document_once_within_capacity():
    from glm46.data.windows import best_fit_bins

    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 50, 200).tolist() + [130]  # one document longer than a bin
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    bins = best_fit_bins(offsets, capacity=64)
    pieces = sorted(p for b in bins for p in b)
    assert all(sum(length for _, length in b) <= 64 for b in bins)
    covered = np.zeros(offsets[-1], dtype=int)
    for start, length in pieces:
        covered[start : start + length] += 1
    assert (covered == 1).all(), "every token in exactly one bin, nothing truncated away"
    assert len(bins) <= int(np.ceil(offsets[-1] / 64)) + 3, "best fit leaves little empty space"


def test_best_fit_samples_restart_positions_and_mask_boundaries(dataset):
    dm = datamodule(dataset, packing="best_fit", seq_len=64)
    batch = next(iter(dm.train_dataloader()))
    eos = dm.index["eos_token_id"]
    for ids, positions, mask in zip(batch["input_ids"], batch["position_ids"], batch["loss_mask"]):
        starts = (positions == 0).nonzero().flatten().tolist()
        assert len(starts) >= 2, "several short documents share a row"
        for boundary in starts[1:]:
            assert mask[boundary - 1] == 0, "no loss on predicting the next document's first token"
            assert ids[boundary - 1] == eos or positions[boundary - 1] == 63


def documents(tokens, offsets):
    return [tuple(tokens[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]


def test_every_domain_holds_out_whole_documents_that_training_never_reads(dataset):
    from glm46.data.shards import load_shard

    dm = datamodule(dataset, val_fraction=0.1)
    for domain, stream in dm.streams.items():
        everything = documents(*load_shard(dataset / "tokens", domain))
        train = documents(stream.train, stream.train_offsets)
        held_out = documents(stream.val, stream.val_offsets)
        assert len(held_out) == 30 and train + held_out == everything
        assert not set(train) & set(held_out), f"{domain}: a held-out document is also a training document"
    # training windows are cut from the training part only; validation from the held-out part only
    training = dm.train_dataloader().dataset
    assert [len(t) for t in training.streams] == [len(dm.streams[d].train) for d in training.domains]
    val = [s for batch in dm.val_dataloader() for s in batch["input_ids"]]
    held_out_tokens = {d: s.val.tolist() for d, s in dm.streams.items()}
    for sample in val:
        assert any(_is_slice(sample.tolist(), tokens) for tokens in held_out_tokens.values())


def _is_slice(part, whole):
    return any(whole[i : i + len(part)] == part for i in range(len(whole) - len(part) + 1))


def test_validation_interleaves_the_domains_so_a_batch_limit_keeps_each(dataset):
    dm = datamodule(dataset, val_fraction=0.1, val_windows=8)
    first = next(iter(dm.val_dataloader()))["input_ids"]
    code, math = (dm.streams[d].val.tolist() for d in ("code", "math"))
    assert _is_slice(first[0].tolist(), code) and _is_slice(first[1].tolist(), math)


def test_pad_packing_puts_one_document_per_row(dataset):
    batch = next(iter(datamodule(dataset, packing="pad", seq_len=64).train_dataloader()))
    for positions, mask, labels in zip(batch["position_ids"], batch["loss_mask"], batch["labels"]):
        starts = (positions == 0).nonzero().flatten().tolist()
        assert len(starts) == 2 and mask[starts[1] :].sum() == 0, "one document, then padding"
        assert (labels[mask == 0] == -100).all()
