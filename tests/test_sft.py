"""SFT data: the GLM chat template's loss mask (assistant tokens only), its recovery from shard ids, and
the SFT DataModule's batches: labels masked outside assistant tokens, positions restarting per packed
conversation, exact resume of the data position."""

import json
import random

import lightning as L
import numpy as np
import pytest
import torch

from glm46.data.chat import ChatTokens, assistant_mask, format_chat, render_chat
from glm46.data.documents import Ledger
from glm46.data.embedded import conversation, generated, offered_tools
from glm46.data.shards import load_shard, write_shards
from glm46.data.tokenizer import GLMTokenizer, train_tokenizer
from glm46.errors import ConfigError
from glm46.lit.sft_data import ConversationTargets, SFTDataModule
from glm46.modules.loss import IGNORE_INDEX

from .helpers import RecordBatches, tiny_config
from .test_balancer import lit_module

TWO_TURNS = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "12 + 30 = 42.\nAnswer: 42"},
    {"role": "user", "content": "Now double it."},
    {"role": "assistant", "content": "<think>42 * 2 = 84</think>\nAnswer: 84"},
]


def make_chat_dataset(root, conversations=300, prompts=200, vocab_size=400, tool_prompts=0):
    """A prepared dataset (documents, tokenizer, shards) of the generated `sft`, `rl` (and `tool`) domains."""
    (root / "documents").mkdir(parents=True)
    texts = {}
    for doc in generated(Ledger(), 0, 0, 0, conversations, prompts, tool_prompts):
        texts.setdefault(doc.domain, {})[doc.text] = None  # exact duplicates dropped, as the preparation does
    texts = {domain: list(docs) for domain, docs in texts.items()}
    for domain, docs in texts.items():
        (root / "documents" / f"{domain}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    tokenizer = GLMTokenizer(train_tokenizer([t for docs in texts.values() for t in docs], vocab_size=vocab_size))
    tokenizer.save(root / "tokenizer.json")
    write_shards(root, tokenizer)
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_chat_dataset(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def tokenizer(dataset):
    return GLMTokenizer.from_file(dataset / "tokenizer.json")


def datamodule(path, **overrides):
    settings = dict(seq_len=640, batch_size=4, mixture={"sft": 1.0}, seed=3)  # a tool chat is ~400 tokens here
    dm = SFTDataModule(str(path), **{**settings, **overrides})
    dm.setup()
    return dm


def test_two_turn_conversation_trains_only_the_assistant_tokens(tokenizer):
    ids, mask = format_chat(TWO_TURNS, tokenizer)
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    # the reply starts with the newline after <|assistant|>: a prompt ends at <|assistant|>, so it is generated
    assert trained == (
        "\n<think></think>\n12 + 30 = 42.\nAnswer: 42<|user|>\n<think>42 * 2 = 84</think>\nAnswer: 84<|endoftext|>"
    )
    untrained = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    assert untrained == (
        "[gMASK]<sop><|system|>\nAnswer briefly.<|user|>\nWhat is 12 + 30?<|assistant|>\nNow double it.<|assistant|>"
    )
    # the rendered text, tokenized as the shard writer does (plus its <|endoftext|>), is format_chat's ids,
    # and the mask is recovered from the ids alone
    assert tokenizer.encode(render_chat(TWO_TURNS)) + [tokenizer.token_id("<|endoftext|>")] == ids
    assert assistant_mask(np.array(ids), ChatTokens(tokenizer)).tolist() == mask
    assert render_chat(TWO_TURNS[:2], add_generation_prompt=True).endswith("What is 12 + 30?<|assistant|>")


def test_generated_conversations_in_the_shards_are_format_chats_ids(dataset, tokenizer):
    tokens, offsets = load_shard(dataset / "tokens", "sft")
    rng = random.Random("0:sft")
    targets = ConversationTargets(tokens, offsets, ChatTokens(tokenizer))
    turns = set()
    for number in range(len(offsets) - 1):
        messages = conversation(rng)
        turns.add(len(messages))
        ids, mask = format_chat(messages, tokenizer, offered_tools(messages))
        start, end = offsets[number], offsets[number + 1]
        assert tokens[start:end].tolist() == ids
        assert targets.span(int(start), int(end - start)).tolist() == mask
        # a conversation cut into pieces keeps its roles: a later piece's mask reads from the conversation's start
        middle = int(start + (end - start) // 2)
        assert targets.span(middle, int(end - middle)).tolist() == mask[middle - start :]
        row = np.asarray(tokens[middle:end], dtype=np.int64)
        assert targets(row, [(middle, int(end - middle))]).tolist() == mask[middle - start :]
    assert {2, 3, 4, 5} <= turns, "one- and two-turn conversations, with and without a system prompt"


def test_batches_label_only_assistant_tokens_and_restart_positions_per_conversation(dataset, tokenizer):
    dm = datamodule(dataset)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids", "loss_mask"}
    assert all(t.shape == (4, 640) for t in batch.values())
    assert torch.equal(batch["labels"] == IGNORE_INDEX, batch["loss_mask"] == 0)
    gmask, assistant = tokenizer.token_id("[gMASK]"), tokenizer.token_id("<|assistant|>")
    for ids, labels, positions in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
        starts = (ids == gmask).nonzero().flatten().tolist()
        assert len(starts) >= 2, "several conversations packed in one row"
        assert (positions[starts] == 0).all() and starts == (positions == 0).nonzero().flatten().tolist()[: len(starts)]
        for begin, end in zip(starts, starts[1:] + [len(ids)]):
            conversation_ids = ids[begin:end].numpy()
            expected = assistant_mask(conversation_ids, ChatTokens(tokenizer))
            # the label of position i is token i + 1, trained iff that token is an assistant token
            trained = (labels[begin:end] != IGNORE_INDEX).numpy()
            assert (trained[:-1] == expected[1:]).all()
            if end < len(ids):
                assert trained[-1] == 0, "no label crosses into the next conversation"
            assert (labels[begin:end][trained.astype(bool)] != assistant).all()
        text = tokenizer.decode(labels[labels != IGNORE_INDEX].tolist())
        assert "<|assistant|>" not in text and "[gMASK]" not in text and "What is" not in text
        assert "Answer:" in text


def text_dataset(root, tokenizer, documents=40):
    """A prepared dataset of plain text (a `code` domain) in `tokenizer`: pre-training data to replay in SFT."""
    (root / "documents").mkdir(parents=True)
    lines = [{"text": f"def f{n}(x):\n    return x * {n} + {n % 7}\n" * 3} for n in range(documents)]
    (root / "documents" / "code.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    tokenizer.save(root / "tokenizer.json")
    write_shards(root, tokenizer)
    return root


def test_replayed_text_trains_every_token_beside_the_conversations(dataset, tokenizer, tmp_path):
    replay = {"path": str(text_dataset(tmp_path / "code", tokenizer)), "mixture": {"code": 1.0}}
    dm = datamodule(dataset, mixture={"sft": 1.0}, replay=replay, batch_size=16)
    batch = next(iter(dm.train_dataloader()))
    gmask = tokenizer.token_id("[gMASK]")
    rows = {"chat": 0, "code": 0}
    for ids, mask, positions in zip(batch["input_ids"], batch["loss_mask"], batch["position_ids"]):
        if ids[0] == gmask:
            rows["chat"] += 1
            continue
        rows["code"] += 1
        used = len(ids) - int((ids.flip(0) != dm.pad_id).int().argmax())  # the padding after the last document
        inside = positions[1:used] != 0  # the next token is in the same document
        assert torch.equal(mask[: used - 1].bool(), inside), "every token of plain text, none across documents"
    assert rows["chat"] and rows["code"], rows
    assert dm.fingerprint.count("+") == 1  # a resume checks both datasets
    other = GLMTokenizer(train_tokenizer(["some other text"] * 20, vocab_size=300))
    with pytest.raises(ConfigError, match="data.path and data.replay.path have different tokenizers"):
        datamodule(dataset, replay={"path": str(text_dataset(tmp_path / "other", other)), "mixture": {"code": 1.0}})
    with pytest.raises(ValueError, match="docs"):
        datamodule(dataset, replay=replay | {"mixture": {"docs": 1.0}})


def test_pad_packing_serves_one_conversation_per_row(dataset):
    batch = next(iter(datamodule(dataset, packing="pad").train_dataloader()))
    for positions, mask in zip(batch["position_ids"], batch["loss_mask"]):
        starts = (positions == 0).nonzero().flatten().tolist()
        assert len(starts) == 2, "one conversation, then padding"
        assert mask[starts[1] :].sum() == 0 and mask[: starts[1]].sum() > 0


def test_random_truncation_is_refused_for_sft(dataset):
    with pytest.raises(ValueError, match="best_fit.*pad"):
        datamodule(dataset, packing="truncate")


def test_validation_reads_held_out_conversations_with_the_same_mask(dataset):
    dm = datamodule(dataset, val_fraction=0.1, val_windows=4)
    batches = list(dm.val_dataloader())
    assert sum(len(b["input_ids"]) for b in batches) == 4
    held_out = dm.streams["sft"].val
    for batch in batches:
        assert torch.equal(batch["labels"] == IGNORE_INDEX, batch["loss_mask"] == 0)
        assert 0 < batch["loss_mask"].float().mean() < 1
    first = batches[0]["input_ids"][0]
    used = int((batches[0]["position_ids"][0] > 0).sum())  # packed documents come from the held-out tokens
    assert np.isin(first[:used].numpy(), np.asarray(held_out)).all()


def fit(dataset, steps, directory, ckpt_path=None):
    recorder = RecordBatches("labels")
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1)
    trainer = L.Trainer(
        max_steps=steps,
        callbacks=[recorder, checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(
        lit_module(tiny_config(vocab_size=400)), datamodule=datamodule(dataset, seq_len=128), ckpt_path=ckpt_path
    )
    return recorder.batches


def test_resume_restores_the_exact_sft_data_position(dataset, tmp_path):
    straight = fit(dataset, 4, tmp_path / "a")
    checkpoint = next((tmp_path / "a").glob("*step=2.ckpt"))
    resumed = fit(dataset, 4, tmp_path / "b", ckpt_path=checkpoint)
    assert len(resumed) == 2 and all(torch.equal(x, y) for x, y in zip(resumed, straight[2:]))
    state = torch.load(checkpoint, weights_only=False)["SFTDataModule"]
    assert state["samples"] == 2 * 4 and state["phase"] == "sft"
