"""Code prompts in RL (glm46.rl.code_reward.Verifier through GRPOLitModule): a chat document whose reference reply
holds a ```tests block becomes a prompt record with those tests, unseen by the policy; its completions score the
share of the tests their program passes in the sandbox; a row the sandbox could not score is left out of the loss
with its group's mean reward, never scored 0; an integer prompt beside it keeps its 0/1."""

import json
import math
from functools import partial

import pytest
import torch

from glm46.data.chat import render_chat
from glm46.data.shards import write_shards
from glm46.data.tokenizer import GLMTokenizer, train_tokenizer
from glm46.errors import ConfigError
from glm46.rl.code_reward import Verifier, extract_tests
from glm46.rl.core_algos import unscored_filled
from glm46.rl.grpo_module import GRPOLitModule
from glm46.rl.grpo_settings import GRPOSettings
from glm46.rl.prompts import PromptDataModule
from glm46.rl.rollout_batch import Rollout
from glm46.sandbox import Limits, Sandbox

from .helpers import tiny_config

pytestmark = pytest.mark.sandbox

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
SOLUTION = "```python\ndef add(a, b):\n    return a + b\n```"
RIGHT, BROKEN = SOLUTION, "```python\ndef add(a, b)\n```"
HALF = "```python\ndef add(a, b):\n    return a + b if a > 0 and a != 2 else -99\n```"  # 2 of the 4 tests


def reference(n: int) -> str:
    return f"{SOLUTION}\n```tests\n" + "\n".join(TESTS + [f"assert add({n}, 0) == {n}"]) + "\n```"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A prepared dataset of one `rl` domain: code prompts, and integer prompts beside them."""
    root = tmp_path_factory.mktemp("code_rl")
    (root / "documents").mkdir()
    texts = [
        render_chat([{"role": "user", "content": f"Write add(a, b). Case {n}."}, {"role": "assistant", "content": r}])
        for n in range(40)
        for r in (reference(n), f"{n} + 1 = {n + 1}.\nAnswer: {n + 1}")
    ]
    (root / "documents" / "rl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = GLMTokenizer(train_tokenizer(texts, vocab_size=400))
    tokenizer.save(root / "tokenizer.json")
    write_shards(root, tokenizer)
    return root


def module(dataset, sandbox: Sandbox) -> GRPOLitModule:
    return GRPOLitModule(
        tiny_config(vocab_size=400),
        optimizer=partial(torch.optim.AdamW, lr=1e-3),
        lr_schedule=lambda tokens: 1.0,
        mtp_weight=lambda tokens: 0.0,
        tokenizer_path=str(dataset / "tokenizer.json"),
        grpo=GRPOSettings(samples_per_prompt=3, max_new_tokens=4),
        reward=Verifier(sandbox),
        seed=0,
    )


def batch_of(dataset) -> dict:
    datamodule = PromptDataModule(str(dataset), seq_len=128, batch_size=8, mixture={"rl": 1.0}, seed=1)
    datamodule.setup()
    return next(iter(datamodule.train_dataloader()))


def completions(model, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [model.tokenizer.encode(text) for text in texts]
    padded = torch.full((len(ids), max(map(len, ids))), model.worker.pad_id)
    for row, encoded in zip(padded, ids):
        row[: len(encoded)] = torch.tensor(encoded)
    return padded, torch.tensor([len(encoded) for encoded in ids])


def test_a_code_prompt_carries_its_tests_and_not_its_reference(dataset):
    model = module(dataset, Sandbox())
    batch = batch_of(dataset)
    records = model.worker.records(batch, samples=2)
    code = [r for r in records if r["tests"]]
    assert code and len(code) < len(records) and records[0] == records[1]  # `samples` copies in a row
    for record, (ids, length) in zip(records[::2], zip(batch["prompt_ids"], batch["prompt_length"])):
        prompt = model.tokenizer.decode(ids[:length].tolist())
        assert "```tests" not in prompt and prompt.endswith("<|assistant|>")
        if record["tests"]:
            case = int(prompt.split("Case ")[1].split(".")[0])
            assert record["tests"] == TESTS + [f"assert add({case}, 0) == {case}"]
        else:
            assert record["answer"] == int(prompt.split("Case ")[1].split(".")[0]) + 1
    assert extract_tests("no block here") == []


def test_code_completions_score_the_share_of_tests_passed_and_integers_their_answer(dataset):
    model = module(dataset, Sandbox(limits=Limits(wall_seconds=3.0, cpu_seconds=1)))
    records = [{"answer": 0, "tests": TESTS + ["assert add(5, 0) == 5"]}] * 3 + [{"answer": 7, "tests": []}] * 2
    ids, lengths = completions(model, [RIGHT, HALF, BROKEN, "Answer: 7", "Answer: 8"])
    assert model.worker.rewards(ids, lengths, records).tolist() == pytest.approx([1.0, 0.5, 0.0, 1.0, 0.0])


def test_a_row_the_sandbox_cannot_score_is_left_out_of_the_loss_not_scored_zero(dataset, monkeypatch):
    model = module(dataset, Sandbox())
    model.worker.reward.checked = True  # it could start at the first code prompt; then it cannot
    batch = batch_of(dataset)
    records = model.worker.records(batch, 3)
    ids, lengths = completions(model, [RIGHT] * len(records))
    monkeypatch.setenv("PATH", "/nonexistent")  # bwrap and prlimit are not found: every run a sandbox error
    verified = model.worker.rewards(ids, lengths, records)
    code = torch.tensor([bool(r["tests"]) for r in records])
    assert verified[code].isnan().all() and not verified[~code].isnan().any()

    rows = len(records)
    rollout = Rollout(torch.zeros(rows, 6, dtype=torch.long), torch.zeros(rows, 6, dtype=torch.long),
                      torch.ones(rows, 6), None)  # fmt: skip
    monkeypatch.setattr(model.worker, "collect", lambda batch, temperature: (rollout, verified.clone(), {}))
    monkeypatch.setattr(model, "log", lambda *args, **kwargs: None)
    out = model.rollout(batch)
    assert (out.mask[code] == 0).all() and (out.mask[~code] == 1).all()
    assert not out.rewards.isnan().any() and (out.advantages[code] == 0).all()


def test_unscored_rows_take_their_groups_mean():
    nan = math.nan
    filled = unscored_filled(torch.tensor([1.0, nan, 0.0, nan, nan, nan]), 3)
    assert filled.tolist() == [1.0, 0.5, 0.0, 0.0, 0.0, 0.0]  # no scored row in the second group: 0


def test_code_prompts_without_a_sandbox_are_refused_naming_the_setting(dataset, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    verifier = Verifier(Sandbox())
    assert verifier({"answer": 3, "tests": []}, "Answer: 3") == 1.0  # integer prompts need no sandbox
    with pytest.raises(ConfigError, match=r"phase\.reward\.sandbox=bubblewrap: .*phase\.reward\.sandbox=none"):
        verifier({"answer": 0, "tests": TESTS}, RIGHT)
