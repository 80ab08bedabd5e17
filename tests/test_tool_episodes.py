"""Agentic RL's pieces: the calculator (a parser of its own, never eval), GLM tool calls read back from text, and
multi-turn episodes played by a scripted policy: what they append, how they end, and what enters the GRPO loss."""

import json
import re

import pytest
import torch

from glm46.data.chat import parse_tool_calls, render_chat
from glm46.data.pipeline import prepare_dataset
from glm46.data.tokenizer import GLMTokenizer, train_tokenizer
from glm46.data.tools import Calculator, ToolEnvironment
from glm46.rl.core_algos import group_advantages, policy_loss
from glm46.rl.episodes import episode_rows, run_episodes
from glm46.rl.prompts import PromptDataModule
from glm46.rl.rewards import verify


@pytest.mark.parametrize(
    "expression, value",
    [("1234 * 56", "69104"), ("(1 + 2) * -3", "-9"), (" 100 / 4 - 7", "18"), ("-(5 - 8)", "3"), ("42", "42")],
)
def test_the_calculator_evaluates_integer_arithmetic(expression, value):
    assert ToolEnvironment().step({"name": "calculator", "arguments": {"expression": expression}}) == value


@pytest.mark.parametrize(
    "call, error",
    [
        ({"name": "calculator", "arguments": {"expression": "__import__('os').system('touch x')"}}, "only integers"),
        ({"name": "calculator", "arguments": {"expression": "2 ** 10"}}, "only integers"),
        ({"name": "calculator", "arguments": {"expression": "7 / 2"}}, "7 / 2 is not an integer"),
        ({"name": "calculator", "arguments": {"expression": "1 / 0"}}, "1 / 0 is not an integer"),
        ({"name": "calculator", "arguments": {"expression": "999999 * 9999999"}}, "more than 12 digits"),
        ({"name": "calculator", "arguments": {"expression": "+".join(["1"] * 20)}}, "more than 16 operations"),
        ({"name": "calculator", "arguments": {"expression": "1 +"}}, "cannot read"),
        ({"name": "calculator", "arguments": {"x": "1"}}, "missing argument 'expression'"),
        ({"name": "search", "arguments": {}}, "no tool named 'search'"),
    ],
)
def test_a_call_the_tool_cannot_serve_returns_an_error_text(call, error):
    result = ToolEnvironment().step(call)
    assert result.startswith("error: ") and error in result


def test_tool_calls_read_back_as_the_template_wrote_them():
    tools = [Calculator().schema]
    arguments = {"expression": "12", "n": 3, "options": {"a": [1, None]}, "flag": True}
    text = render_chat(
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "Let me compute.",
                "tool_calls": [{"name": "calculator", "arguments": arguments}],
            },
        ],
        tools,
    )
    # the schema says `expression` is a string: "12" stays one; the others are read back as the JSON they were
    assert parse_tool_calls(text.split("<|assistant|>")[-1], tools) == [{"name": "calculator", "arguments": arguments}]
    for broken in ("<tool_call>calculator", "<tool_call>\n</tool_call>", "<tool_call>calculator\nstray</tool_call>"):
        with pytest.raises(ValueError):
            parse_tool_calls(broken, tools)
    assert parse_tool_calls("no call here") == []


CALL = (
    "\n<think></think>\n<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>{}</arg_value>\n</tool_call>"
)


@pytest.fixture(scope="module")
def tokenizer():
    texts = [CALL.format("1234 * 56") + "Answer: 69104 error: calculator tool_response"] * 20
    return GLMTokenizer(train_tokenizer(texts, vocab_size=300))


def scripted(tokenizer, turns: dict[int, list[str]]):
    """A policy that writes `turns[episode][k]` as its k-th turn, with log-prob -0.5 per token."""
    written = {i: 0 for i in turns}

    def generate(contexts, max_new_tokens, active):
        out = []
        for i in active:
            ids = tokenizer.encode(turns[i][written[i]])[:max_new_tokens]
            written[i] += 1
            out.append((ids, [-0.5] * len(ids)))
        return out

    return generate


def test_episodes_append_tool_results_as_glms_template_and_end_as_agentic_rl_does(tokenizer):
    question = [{"role": "user", "content": "What is 1234 * 56?"}]
    tools = [Calculator().schema]
    prompt = tokenizer.encode(render_chat(question, tools, add_generation_prompt=True))
    answer = "\n<think>The tool says 69104.</think>\nAnswer: 69104<|endoftext|>"
    turns = {
        0: [CALL.format("1234 * 56") + "<|observation|>", answer],  # a call, its result, the right answer
        1: ["\n<think></think>\n<tool_call>calculator\nbroken</tool_call><|observation|>"],  # does not parse
        2: [CALL.format("1234 ** 56") + "<|observation|>", "\n<think></think>\nAnswer: 5<|endoftext|>"],  # refused
        3: [CALL.format("1 + 1") + "<|observation|>"] * 3,  # calls until out of turns
        4: ["\n<think>" + "long " * 400],  # no stop token within the budget
    }
    episodes = run_episodes(
        [prompt] * 5,
        [{"answer": 69104}] * 5,
        scripted(tokenizer, turns),
        tokenizer,
        verify,
        [ToolEnvironment()] * 5,
        max_turns=3,
        max_tokens=192,
    )
    assert [(e.ended, e.reward, e.turns, e.tool_calls) for e in episodes] == [
        ("answered", 1.0, 2, 1),
        ("unparsed_call", 0.0, 1, 0),
        ("answered", 0.0, 2, 1),
        ("out_of_turns", 0.0, 3, 2),
        ("out_of_tokens", 0.0, 1, 0),
    ]
    # the played episode is GLM-4.6's rendering of the conversation, token for token
    conversation = question + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "calculator", "arguments": {"expression": "1234 * 56"}}],
        },
        {"role": "tool", "content": "69104"},
        {"role": "assistant", "content": "<think>The tool says 69104.</think>\nAnswer: 69104"},
    ]
    first = episodes[0]
    assert prompt + first.tokens == tokenizer.encode(render_chat(conversation, tools)) + [
        tokenizer.token_id("<|endoftext|>")
    ]
    trained = tokenizer.decode([t for t, m in zip(first.tokens, first.model_mask) if m])
    assert trained == CALL.format("1234 * 56") + "<|observation|>" + answer
    context = tokenizer.decode([t for t, m in zip(first.tokens, first.model_mask) if not m])
    assert context == "\n<tool_response>\n69104\n</tool_response><|assistant|>"
    assert "error: calculator: only integers" in tokenizer.decode(episodes[2].tokens)
    assert len(episodes[4].tokens) == 192

    # Training rows: only the model's tokens are targets, with the sampler's log-probs at their positions; GRPO's
    # token-mean loss at ratio 1 is -sum(A_i * n_i) / sum(n_i) over the model's token counts n_i
    input_ids, targets, mask, logprobs = episode_rows(episodes, pad_id=tokenizer.token_id("<|endoftext|>"))
    counts = torch.tensor([float(sum(e.model_mask)) for e in episodes])
    assert torch.equal(mask.sum(1), counts) and torch.equal(logprobs, -0.5 * mask)
    row = episodes[0]
    p = len(row.prompt)
    assert torch.equal(input_ids[0, : p + len(row.tokens)], torch.tensor(row.prompt + row.tokens))
    assert [int(t) for t in targets[0] if t >= 0] == [t for t, m in zip(row.tokens, row.model_mask) if m]
    rewards = torch.tensor([e.reward for e in episodes])
    advantages = group_advantages(rewards, 5, True)
    current = logprobs.clone().requires_grad_(True)
    loss, _ = policy_loss(current, logprobs, advantages, mask)
    assert loss.item() == pytest.approx(float(-(advantages * counts).sum() / counts.sum()), rel=1e-6)


def test_a_tool_conversation_is_a_prompt_up_to_its_reply_with_the_answer_of_its_last_turn(tmp_path):
    tools = [Calculator().schema]
    records = []
    for a, b in ((1234, 56), (4321, 12), (2222, 33)):
        call = {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
        messages = [
            {"role": "user", "content": f"What is {a} * {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": f"Answer: {a * b}"},
        ]
        records.append({"messages": messages, "tools": tools})
    plain = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "Answer: 5"}]
    records.append({"messages": plain})
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    near = {"near": False}  # the conversations differ only in their numbers
    prepare_dataset("chat", [str(tmp_path / "chats.jsonl")], tmp_path / "out", default_domain="rl", dedup=near)
    dm = PromptDataModule(str(tmp_path / "out"), seq_len=512, batch_size=8, mixture={"rl": 1.0}, val_fraction=0.0)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    seen = set()
    for ids, length, answer, offers in zip(
        batch["prompt_ids"], batch["prompt_length"], batch["answer"], batch["tools"]
    ):
        prompt = dm.tokenizer.decode(ids[:length].tolist())
        assert prompt.endswith("?<|assistant|>") and "<|observation|>" not in prompt  # the episode starts here
        question = re.search(r"What is (\d+) ([*+]) (\d+)\?", prompt)
        a, op, b = int(question.group(1)), question.group(2), int(question.group(3))
        assert int(answer) == (a * b if op == "*" else a + b) and bool(offers) == (op == "*")
        seen.add(bool(offers))
    assert seen == {True, False}


def test_a_turn_that_reaches_its_own_bound_ends_the_episode_out_of_tokens(tokenizer):
    """turn_tokens (the evaluation's max_gen_toks per turn) bounds each turn; the episode's bound stays max_tokens."""
    prompt = tokenizer.encode(
        render_chat([{"role": "user", "content": "What is 1234 * 56?"}], add_generation_prompt=True)
    )
    turns = {0: [CALL.format("1234 * 56") + "<|observation|>", "\n<think></think>\nAnswer: 69104<|endoftext|>"]}
    call_length = len(tokenizer.encode(turns[0][0]))
    for bound, ended in ((call_length, "answered"), (call_length - 1, "out_of_tokens")):
        (episode,) = run_episodes(
            [prompt], [{"answer": 69104}], scripted(tokenizer, dict(turns)), tokenizer, verify, [ToolEnvironment()],
            max_turns=2, max_tokens=192, turn_tokens=bound,
        )  # fmt: skip
        assert episode.ended == ended and episode.turns == (2 if ended == "answered" else 1)
