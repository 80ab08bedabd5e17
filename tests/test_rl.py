"""RL data: the verifiable-answer reward, the generated prompts, and the prompt DataModule."""

import random
import re
from pathlib import Path

import pytest
import torch

from glm46.data.embedded import expression_problem, rl_prompt
from glm46.rl.prompts import PromptDataModule
from glm46.rl.rewards import extract_answer, verify

from .test_sft import make_chat_dataset

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("7 * 3 = 21. Then 12 + 21 = 33.\nAnswer: 33", 1.0),
        ("Answer: 33.", 1.0),
        ("so the result is \\boxed{33}", 1.0),
        ("Answer: \\boxed{ 33 }", 1.0),
        ("Answer: 12\nOn second thought, Answer: 33", 1.0),  # the last final answer counts
        ("Answer: 34", 0.0),  # wrong
        ("Answer: 33\nAnswer: 34", 0.0),
        ("Answer: 33<|endoftext|><|endoftext|>", 1.0),  # a decoded completion, padded after its stop token
        ("Answer: 33<|user|>\nAnswer: 34", 1.0),  # what follows a stop token is not the reply
        ("Answer: -33", 0.0),
        ("The answer is 33", 0.0),  # malformed: no final-answer line
        ("Answer: thirty-three", 0.0),
        ("Answer: 33.0", 0.0),
        ("Answer: 33 apples", 0.0),
        ("\\boxed{}", 0.0),
        ("", 0.0),
    ],
)
def test_verify_rewards_only_the_right_integer_in_the_answer_format(completion, reward):
    assert verify({"answer": 33}, completion) == reward


def test_verify_takes_the_answer_from_a_tensor_record_and_negative_numbers():
    assert verify({"answer": torch.tensor(-5)}, "Answer: -5") == 1.0
    assert extract_answer("Answer: +7") == 7 and extract_answer("no answer") is None


def test_generated_expressions_have_the_right_answer_and_reference_reply():
    rng = random.Random(0)
    for _ in range(500):
        expression, steps, answer = expression_problem(rng)
        assert eval(expression) == answer  # Python's precedence is arithmetic's
        assert verify({"answer": answer}, f"{steps}\nAnswer: {answer}") == 1.0
    messages = rl_prompt(random.Random(1))
    assert messages[-1]["role"] == "assistant" and messages[-2]["role"] == "user"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_chat_dataset(tmp_path_factory.mktemp("rl"))


def test_prompts_end_with_the_assistant_token_and_carry_the_reference_answer(dataset):
    dm = PromptDataModule(str(dataset), seq_len=128, batch_size=8, mixture={"rl": 1.0}, seed=1)
    dm.setup()
    tokenizer = dm.tokenizer
    tokens = dm.streams["rl"].train
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"prompt_ids", "prompt_length", "answer", "tests_ids", "tests_length", "tools", "index"}
    assert batch["prompt_ids"].shape == (8, 128) and not batch["tools"].any()  # no tools block in these prompts
    assert not batch["tests_length"].any()  # integer answers, no code prompt's tests (tests/test_code_rl.py)
    assert batch["index"].tolist() == list(range(8))  # the global sample indices: they seed each prompt's sampling
    for ids, length, answer in zip(batch["prompt_ids"], batch["prompt_length"], batch["answer"]):
        prompt = tokenizer.decode(ids[:length].tolist())
        assert prompt.startswith("[gMASK]<sop>") and prompt.endswith("<|assistant|>")
        assert prompt.count("<|assistant|>") == 1 and "Answer: <integer>" in prompt
        assert (ids[length:] == dm.pad_id).all()
        expression = re.search(r"\d [-+*] \d", prompt).group(0)
        assert eval(expression) == int(answer)
        # the prompt is a document's start, and the document's reference reply earns the reward
        start = next(
            s
            for ((s, _),) in dm.bins["rl"]
            if torch.equal(torch.from_numpy(tokens[s : s + length].astype("int64")), ids[:length])
        )
        ((_, doc_length),) = next(b for b in dm.bins["rl"] if b[0][0] == start)
        reply = tokenizer.decode(tokens[start + length : start + doc_length].tolist())
        assert verify({"answer": answer}, reply) == 1.0


def test_prompts_longer_than_seq_len_are_left_out_and_none_fitting_is_an_error(dataset):
    dm = PromptDataModule(str(dataset), seq_len=60, batch_size=2, mixture={"rl": 1.0})
    dm.setup()
    everything = PromptDataModule(str(dataset), seq_len=512, batch_size=2, mixture={"rl": 1.0})
    everything.setup()
    assert 0 < len(dm.bins["rl"]) < len(everything.bins["rl"])
    assert all(length <= 60 for length in next(iter(dm.train_dataloader()))["prompt_length"])
    with pytest.raises(ValueError, match="no chat document with a prompt of at most seq_len=8"):
        PromptDataModule(str(dataset), seq_len=8, batch_size=2, mixture={"rl": 1.0}).setup()


def test_held_out_prompts_are_disjoint_from_training_prompts(dataset):
    dm = PromptDataModule(str(dataset), seq_len=128, batch_size=4, mixture={"rl": 1.0}, val_fraction=0.1)
    dm.setup()
    train = dm.train_dataloader()
    seen = set()
    for _, batch in zip(range(30), train):
        seen |= {tuple(ids[:n].tolist()) for ids, n in zip(batch["prompt_ids"], batch["prompt_length"])}
    held_out = [
        tuple(ids[:n].tolist())
        for batch in dm.val_dataloader()
        for ids, n in zip(batch["prompt_ids"], batch["prompt_length"])
    ]
    assert len(held_out) == 20 and not seen & set(held_out)
