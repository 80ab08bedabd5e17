"""Preference pairs from TRL's format to batches: every bad line counted under its reason at its file:line, pairs
deduplicated by prompt, two preparation tasks equal to one, and each served side exactly the rendered conversation
with its reply's tokens masked."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from glm46.data.chat import EOS, render_chat
from glm46.data.documents import Ledger
from glm46.data.pipeline import DEDUP_DEFAULTS, prepare_dataset, run_preparation
from glm46.data.preference import SIDES, read_preference
from glm46.data.preference_task import STYLES, preference_pairs, style_prompts, write_task
from glm46.data.quality import QualityRules
from glm46.data.tokenizer import GLMTokenizer
from glm46.lit.preference_data import REFERENCE, PreferenceDataModule, split_pair
from glm46.rl.style_rule import follows_style

VOCAB = 400
ROOT = Path(__file__).resolve().parents[1]

GOOD = {"prompt": "What is 2 + 2?", "chosen": "Answer: 4", "rejected": "Answer: 5"}
BAD_LINES = [  # (line, reason)
    ('{"prompt": "x", "chosen": "a", ', "malformed"),  # bad JSON
    (json.dumps({"chosen": "a", "rejected": "b"}), "preference/no_prompt"),
    (json.dumps({"prompt": "  ", "chosen": "a", "rejected": "b"}), "preference/no_prompt"),
    (json.dumps({"prompt": "x", "chosen": "a"}), "preference/missing_side"),
    (json.dumps({"prompt": "x", "chosen": [], "rejected": "b"}), "preference/missing_side"),
    (json.dumps({"prompt": "x", "chosen": "same", "rejected": "same"}), "preference/identical"),
    (json.dumps({"prompt": [{"role": "wizard", "content": "x"}], "chosen": "a", "rejected": "b"}), "chat/unknown_role"),
    (json.dumps({"prompt": "x", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}),
     "preference/reply_not_assistant"),
    (json.dumps({"prompt": "x", "chosen": 3, "rejected": "b"}), "malformed"),
    (json.dumps(["prompt", "chosen", "rejected"]), "malformed"),
]  # fmt: skip


def test_every_bad_line_is_counted_under_its_reason_at_its_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join([json.dumps(GOOD), *(line for line, _ in BAD_LINES)]) + "\n")
    ledger = Ledger()
    docs = list(read_preference([str(path)], ledger))
    assert len(docs) == 1 and ledger.documents_in == 1 + len(BAD_LINES)
    expected = {}
    for number, (_, reason) in enumerate(BAD_LINES, start=2):
        expected.setdefault(reason, []).append(f"{path}:{number}")
    assert dict(ledger.dropped) == {reason: len(lines) for reason, lines in expected.items()}
    for reason, lines in expected.items():
        assert [example.split(": ")[0] for example in ledger.examples[reason]] == lines


def test_a_pair_is_its_conversations_and_keeps_the_first_pair_of_a_prompt(tmp_path):
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    conversational = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "chosen": [{"role": "assistant", "content": "Hello!"}],
        "rejected": [{"role": "assistant", "content": "Go away."}],
        "tools": tools,
    }
    path = tmp_path / "pairs.jsonl"
    again = {**GOOD, "chosen": "Answer: four"}  # the same prompt: deduplicated
    path.write_text("".join(json.dumps(r) + "\n" for r in (GOOD, conversational, again)))
    docs = list(read_preference([str(path)], Ledger()))
    prompt = conversational["prompt"]
    head, chosen, rejected = (render_chat(m, tools) for m in (prompt, *(prompt + conversational[s] for s in SIDES)))
    assert docs[1].text == chosen + EOS + rejected.removeprefix(head) and docs[1].key == head  # the prompt once
    manifest = prepare_dataset(
        "preference", [str(path)], tmp_path / "out", default_domain="preference", vocab_size=VOCAB
    )
    assert manifest["documents_out"] == 2 and manifest["dropped"] == {"exact_duplicate": 1}
    assert manifest["examples"]["exact_duplicate"] == [f"{path}:3"]


@pytest.fixture(scope="module")
def preference_dataset(tmp_path_factory) -> Path:
    """The generated style task's pairs, prepared (a 400-token vocabulary)."""
    root = tmp_path_factory.mktemp("preference")
    pairs, _ = write_task(root, pairs=300, prompts=0)
    prepare_dataset("preference", [str(pairs)], root / "data", default_domain="preference", vocab_size=VOCAB)
    return root / "data"


def test_two_preparation_tasks_equal_one(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    records = list(preference_pairs(120, 0))
    pairs.write_text("".join(json.dumps(r) + "\n" for r in records[:60]))
    (tmp_path / "more.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[60:]))
    outputs = {}
    for tasks in (1, 2):
        out = tmp_path / f"tasks-{tasks}"
        run_preparation(
            {"reader": "preference", "paths": [str(pairs), str(tmp_path / "more.jsonl")], "output_dir": str(out),
             "default_domain": "preference", "options": {}},
            {"tasks": tasks, "num_workers": 2, "dedup": DEDUP_DEFAULTS, "quality": vars(QualityRules()),
             "tokenizer": {"path": None, "vocab_size": VOCAB, "max_digits": 3}},
        )  # fmt: skip
        outputs[tasks] = out
    for name in ("tokens/preference.bin", "tokens/preference.idx.npy", "tokenizer.json"):
        assert (outputs[1] / name).read_bytes() == (outputs[2] / name).read_bytes(), name


def test_each_side_is_its_conversation_with_the_reply_masked(preference_dataset):
    """Samples rebuild the records' conversations token for token; the mask is the reply, after the shared prompt."""
    tokenizer = GLMTokenizer.from_file(preference_dataset / "tokenizer.json")
    records = {r["id"]: r for r in preference_pairs(300, 0)}
    kept = [json.loads(line)["id"] for line in (preference_dataset / "documents" / "preference.jsonl").open()]
    data = PreferenceDataModule(str(preference_dataset), seq_len=512, batch_size=4, mixture={"preference": 1.0})
    data.setup()
    assert len(data.bins["preference"]) == len(data.streams["preference"].train_offsets) - 1  # all fit: item = doc
    pairs = data.dataset({"preference": data.streams["preference"].train}, {"preference": 1.0}, 512, 0, 0, 0, 1,
                         bins=data.bins, pad_id=data.pad_id)  # fmt: skip
    for item in range(0, 200, 37):
        sample, record = pairs.sample(0, item), records[kept[item]]
        prompt = sample["prompt_length"]
        for side in SIDES:
            ids, mask, length = (sample[f"{side}_{key}"] for key in ("ids", "mask", "length"))
            assert tokenizer.decode(ids[:length].tolist()) == render_chat(record["prompt"] + record[side]) + EOS
            assert (ids[length:] == data.pad_id).all()
            reply = tokenizer.decode(ids[mask.astype(bool)].tolist())
            assert reply == "\n<think></think>\n" + record[side][0]["content"] + EOS
            assert not mask[:prompt].any() and mask[prompt:length].all() and not mask[length:].any()
        assert tokenizer.decode(sample["chosen_ids"][:prompt].tolist()) == render_chat(
            record["prompt"], add_generation_prompt=True
        )
    batch = next(iter(data.train_dataloader()))
    assert batch["chosen_ids"].shape == batch["rejected_ids"].shape == (4, 512)
    chosen = [tokenizer.decode(row[m.bool()].tolist()) for row, m in zip(batch["chosen_ids"], batch["chosen_mask"])]
    prompts = [tokenizer.decode(row[:n].tolist()) for row, n in zip(batch["chosen_ids"], batch["prompt_length"])]
    styles = ["brief" if STYLES["brief"] in prompt else "worked" for prompt in prompts]
    assert all(map(follows_style, styles, chosen))  # the generated task's hidden rule holds for the chosen


def test_pairs_longer_than_seq_len_are_left_out(preference_dataset):
    def served(seq_len: int) -> int:
        data = PreferenceDataModule(str(preference_dataset), seq_len=seq_len, batch_size=2, mixture={"preference": 1})
        data.setup()
        return len(data.bins["preference"])

    lengths = []
    data = PreferenceDataModule(str(preference_dataset), seq_len=512, batch_size=2, mixture={"preference": 1})
    data.setup()
    for ((start, length),) in data.bins["preference"]:
        chosen, rejected, _ = split_pair(
            np.asarray(data.streams["preference"].train[start : start + length]), data.chat
        )
        lengths.append(max(len(chosen), len(rejected)))
    cut = int(np.median(lengths))
    assert served(cut) == sum(n <= cut for n in lengths) < len(lengths) == served(512)


def test_pairs_left_out_for_length_are_counted_and_logged_and_none_fitting_is_named(preference_dataset, caplog):
    def module(seq_len: int) -> PreferenceDataModule:
        return PreferenceDataModule(str(preference_dataset), seq_len=seq_len, batch_size=2, mixture={"preference": 1})

    def longer_sides(data: PreferenceDataModule, split: str) -> list[int]:
        stream = data.streams["preference"]
        tokens, offsets = getattr(stream, split), getattr(stream, f"{split}_offsets")
        sides = [split_pair(np.asarray(tokens[a:b]), data.chat)[:2] for a, b in zip(offsets, offsets[1:])]
        return [max(len(chosen), len(rejected)) for chosen, rejected in sides]

    whole = module(512)
    whole.setup()
    assert whole.dropped_overlong == {"train": 0, "val": 0}
    lengths = {split: longer_sides(whole, split) for split in ("train", "val")}
    cut = int(np.median(lengths["train"]))
    with caplog.at_level(logging.INFO, logger="glm46.lit.preference_data"):
        data = module(cut)
        data.setup()
        data.setup()  # fit, then validate: nothing counted twice
    dropped = {split: sum(n > cut for n in lengths[split]) for split in lengths}
    assert data.dropped_overlong == dropped and dropped["train"] > 0 and dropped["val"] > 0
    assert caplog.text.count("preference pairs left out") == 1
    assert (
        f"domain 'preference': {dropped['train']} of {len(lengths['train'])} training and {dropped['val']} of "
        f"{len(lengths['val'])} held-out preference pairs left out, a side longer than data.seq_len={cut}"
    ) in caplog.text
    shortest, longest = min(lengths["train"]), max(lengths["train"])
    named = rf"data.seq_len={shortest - 1} .*side: {shortest} tokens, the longest side: {longest}"
    with pytest.raises(ValueError, match=named):
        module(shortest - 1).setup()


@pytest.mark.parametrize(
    ("style", "reply", "follows"),
    [
        ("brief", "\n<think></think>\nAnswer: 56<|endoftext|>", True),
        ("brief", "7 * 8 = 56.\nAnswer: 56", False),
        ("worked", "7 * 8 = 56.\nAnswer: 56<|user|>\nAnswer: 1", True),  # what follows a stop token is not the reply
        ("worked", "Answer: 56", False),
        ("brief", "Answer: fifty-six", False),  # no integer on the answer line
        (None, "Answer: 56", False),  # the prompt asked for no style
    ],
)
def test_the_hidden_rule(style, reply, follows):
    assert follows_style(style, reply) is follows


def test_shuffled_labels_swap_every_other_training_draw_and_no_held_out_pair(preference_dataset):
    def batches(shuffle: bool) -> tuple[dict, dict]:
        data = PreferenceDataModule(str(preference_dataset), seq_len=128, batch_size=64, mixture={"preference": 1},
                                    shuffle_labels=shuffle)  # fmt: skip
        data.setup()
        data.reference = {  # DPO's table swaps with its sides
            "train": {"preference": np.arange(2 * len(data.bins["preference"]), dtype=np.float32).reshape(-1, 2)},
            "val": {"preference": np.zeros((len(data.val_bins["preference"]), 2), dtype=np.float32)},
        }
        return next(iter(data.train_dataloader())), next(iter(data.val_dataloader()))

    (plain, val), (shuffled, shuffled_val) = batches(False), batches(True)
    odd = torch.arange(64) % 2 == 1  # each batch as many of one orientation as of the other
    for chosen, rejected in [(f"chosen_{f}", f"rejected_{f}") for f in ("ids", "mask", "length")] + [REFERENCE]:
        assert torch.equal(shuffled[chosen][odd], plain[rejected][odd])
        assert torch.equal(shuffled[chosen][~odd], plain[chosen][~odd])
    assert all(torch.equal(val[key], shuffled_val[key]) for key in val)


def test_no_rl_or_held_out_prompt_is_a_prompt_the_reward_model_and_dpo_train_on():
    """The style prompts (RL's, and the held-out skill) and the pairs' prompts come from two halves of the prompt
    space: at the toy run's counts none is shared (drawn from one space, 31% of the distinct style prompts were)."""
    options = OmegaConf.load(ROOT / "conf/source/embedded_preference.yaml").options
    pairs = {json.dumps(r["prompt"]) for r in preference_pairs(options.preference_pairs, 0)}
    prompts = {json.dumps(r["messages"][:-1]) for r in style_prompts(options.style_prompts, 0)}
    assert len(pairs) > 2000 and len(prompts) > 1500 and not pairs & prompts
