"""Chat and preference data in the layouts people have: ShareGPT, Alpaca and TRL's prompt-completion conversations
render as the OpenAI messages they mean; implicit-prompt pairs (whole conversations, Anthropic HH's text) are the
explicit pairs they mean; every record that is none, and every side that is not one reply, is counted under its
reason at its file:line; and a pair whose prompt ends with tool results is served as its two conversations."""

import json

import numpy as np

from glm46.data.chat import EOS, ChatTokens, render_chat
from glm46.data.chat_formats import read_chat
from glm46.data.documents import Ledger
from glm46.data.pipeline import prepare_dataset
from glm46.data.preference import read_preference
from glm46.data.shards import load_shard
from glm46.data.tokenizer import GLMTokenizer
from glm46.lit.preference_data import PreferenceDataModule, pair_lengths

WEATHER = {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TOOLS = [{"type": "function", "function": WEATHER}]  # OpenAI's form of LLaMA-Factory's bare schema
WEATHER_CALL = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich"}}}
TOOL_CHAT = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "The weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "Sunny."},
]
SHAREGPT_TURNS = [
    {"from": "human", "value": "The weather in Zürich?"},
    {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Zürich"}})},
    {"from": "observation", "value": "sunny"},
    {"from": "gpt", "value": "Sunny."},
]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def written(tmp_path, records: list) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def counted(ledger: Ledger) -> dict[str, list[str]]:
    """reason -> the file:line of each example."""
    return {reason: [example.split(": ")[0] for example in examples] for reason, examples in ledger.examples.items()}


def test_sharegpt_alpaca_and_prompt_completion_render_as_their_openai_messages(tmp_path):
    history = [user("Hi"), assistant("Hello!")]
    cases = [  # (record, the OpenAI messages and tools it means)
        ({"conversations": SHAREGPT_TURNS, "system": "Use the tools.", "tools": json.dumps([WEATHER])},
         TOOL_CHAT, TOOLS),
        ({"messages": [{"from": "system", "value": "Use the tools."}, *SHAREGPT_TURNS], "tools": [WEATHER]},
         TOOL_CHAT, TOOLS),
        ({"instruction": "Add the numbers.", "input": "2 and 3", "output": "5", "system": "Be brief.",
          "history": [["Hi", "Hello!"]]},
         [{"role": "system", "content": "Be brief."}, *history, user("Add the numbers.\n2 and 3"), assistant("5")],
         None),
        ({"instruction": "Say hi.", "input": "", "output": "hi"}, [user("Say hi."), assistant("hi")], None),
        ({"prompt": "What is 2 + 2?", "completion": "4"}, [user("What is 2 + 2?"), assistant("4")], None),
        ({"prompt": [*history, user("And 2 + 2?")], "completion": [assistant("4")]},
         [*history, user("And 2 + 2?"), assistant("4")], None),
        ({"messages": TOOL_CHAT, "tools": TOOLS}, TOOL_CHAT, TOOLS),
    ]  # fmt: skip
    ledger = Ledger()
    docs = list(read_chat([written(tmp_path, [record for record, _, _ in cases])], ledger))
    assert not ledger.dropped
    assert [doc.text for doc in docs] == [render_chat(messages, tools) for _, messages, tools in cases]


def test_a_record_of_no_layout_or_a_bad_turn_is_counted_at_its_line(tmp_path):
    bad = [
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "wizard", "value": "a"}]}, "chat/unknown_role"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{weather"}],
          "tools": [WEATHER]}, "chat/arguments_not_json"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "observation", "value": "r"}]},
         "chat/tool_result_without_call"),
        ({"question": "q", "answer": "a"}, "malformed"),
        ({"instruction": "q"}, "malformed"),  # no output
        ({"prompt": "q", "completion": 4}, "malformed"),
    ]  # fmt: skip
    path = written(tmp_path, [{"prompt": "q", "completion": "a"}, *(record for record, _ in bad)])
    ledger = Ledger()
    assert len(list(read_chat([path], ledger))) == 1
    expected = {}
    for number, (_, reason) in enumerate(bad, start=2):
        expected.setdefault(reason, []).append(f"{path}:{number}")
    assert counted(ledger) == expected
    assert ledger.examples["chat/unknown_role"][0] == (
        f"{path}:2: turn 1: from 'wizard' is not one of ['assistant', 'function_call', 'gpt', 'human', 'model', "
        "'observation', 'system', 'tool', 'tool_call', 'user']"
    )
    no_layout = ledger.examples["malformed"][0]
    assert "fields: question, answer" in no_layout and "'conversations' (ShareGPT)" in no_layout


def test_an_implicit_prompt_pair_is_the_explicit_pair_it_means(tmp_path):
    prompt = [user("Hi"), assistant("Hello! How can I help?"), user("What is 2 + 2?")]
    chosen, rejected = assistant("4"), assistant("5")
    explicit = {"prompt": prompt, "chosen": [chosen], "rejected": [rejected]}
    implicit = {"chosen": [*prompt, chosen], "rejected": [*prompt, rejected]}
    hh = "\n\nHuman: Hi\n\nAssistant: Hello! How can I help?\n\nHuman: What is 2 + 2?\n\nAssistant: "
    anthropic = {"chosen": hh + "4", "rejected": hh + "5"}
    system = {"role": "system", "content": "Be brief."}
    with_system = {"prompt": [system, *prompt], "chosen": "4", "rejected": "5"}  # a string side: one assistant turn
    implicit_system = {"chosen": [system, *prompt, chosen], "rejected": [system, *prompt, rejected]}
    records = [explicit, implicit, anthropic, with_system, implicit_system]
    ledger = Ledger()
    docs = list(read_preference([written(tmp_path, records)], ledger))
    assert not ledger.dropped and len(docs) == 5
    head = render_chat(prompt)
    assert docs[0].text == render_chat([*prompt, chosen]) + EOS + render_chat([*prompt, rejected]).removeprefix(head)
    assert [(d.text, d.key) for d in docs[1:3]] == [(docs[0].text, docs[0].key)] * 2
    assert (docs[4].text, docs[4].key) == (docs[3].text, docs[3].key) != (docs[0].text, docs[0].key)


def test_every_wrong_side_is_counted_under_its_reason_at_its_line(tmp_path):
    call = {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]}
    result = {"role": "tool", "content": "sunny"}
    thought = {"role": "assistant", "content": "<think>Greet back.</think>Hello!"}
    bad = [
        ({"prompt": "q", "chosen": [assistant("a"), user("more?"), assistant("b")], "rejected": "c"},
         "preference/side_has_user_turn"),
        ({"prompt": "q", "chosen": [assistant("a"), {"role": "system", "content": "s"}], "rejected": "c"},
         "preference/side_has_system_turn"),
        # what pair_text's assert caught: a reasoning the later user turn hides changes how the prompt renders
        ({"prompt": [user("Hi"), thought], "chosen": [assistant("a"), user("q"), assistant("b")], "rejected": "c"},
         "preference/prompt_ends_with_assistant"),
        ({"chosen": [user("Hi"), assistant("Hello"), user("q"), assistant("a")],
          "rejected": [user("Hi"), assistant("Hello"), user("other q"), assistant("b")]},
         "preference/prompt_ends_with_assistant"),  # implicit: the sides part at a user turn
        ({"prompt": [{"role": "system", "content": "s"}], "chosen": "a", "rejected": "b"},
         "preference/prompt_ends_with_system"),
        ({"chosen": [user("q"), assistant("a")], "rejected": [user("another q"), assistant("b")]},
         "preference/no_prompt"),  # no common prefix
        ({"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: other\n\nAssistant: b"},
         "preference/no_prompt"),
        ({"chosen": "q? a", "rejected": "q? b"}, "preference/no_prompt"),  # no HH markers
        ({"prompt": [call, result], "chosen": "a", "rejected": "b", "tools": TOOLS}, "preference/no_prompt"),
        ({"chosen": [user("q"), assistant("a")], "rejected": [user("q"), assistant("a")]}, "preference/identical"),
        ({"chosen": [user("q"), assistant("a")], "rejected": [user("q")]}, "preference/missing_side"),
        ({"prompt": "q", "chosen": [call, result], "rejected": "b", "tools": TOOLS}, "preference/reply_ends_with_tool"),
        ({"prompt": "q", "chosen": [result, assistant("a")], "rejected": "b"}, "chat/tool_result_without_call"),
    ]  # fmt: skip
    path = written(tmp_path, [{"prompt": "q", "chosen": "a", "rejected": "b"}, *(record for record, _ in bad)])
    ledger = Ledger()
    assert len(list(read_preference([path], ledger))) == 1 and ledger.documents_in == 1 + len(bad)
    expected = {}
    for number, (_, reason) in enumerate(bad, start=2):
        expected.setdefault(reason, []).append(f"{path}:{number}")
    assert counted(ledger) == expected
    assert ledger.examples["preference/side_has_user_turn"] == [
        f"{path}:2: chosen: reply message 1 is a 'user' turn (a side is one reply)"
    ]


def test_a_prompt_ending_with_tool_results_is_served_as_its_two_conversations(tmp_path):
    """Prepared end to end: a pair whose prompt ends with a call's result (its tool-using tail is stored as the
    opening of both replies), and an HH pair. Each side served is its whole conversation, its reply masked from the
    call on, the tool result not."""
    prompt, question = TOOL_CHAT[:4], "Name a prime number between 10 and 15."
    hh = f"\n\nHuman: {question}\n\nAssistant: "
    records = [
        {"prompt": prompt, "chosen": "Sunny, 24 degrees.", "rejected": "It rains.", "tools": TOOLS},
        {"chosen": hh + "Eleven, or thirteen.", "rejected": hh + "Twelve."},
    ]
    conversations = [  # (chosen, rejected, tools)
        ([*prompt, assistant("Sunny, 24 degrees.")], [*prompt, assistant("It rains.")], TOOLS),
        ([user(question), assistant("Eleven, or thirteen.")], [user(question), assistant("Twelve.")], None),
    ]
    out = tmp_path / "out"
    manifest = prepare_dataset(
        "preference", [written(tmp_path, records)], out, default_domain="preference", vocab_size=400
    )
    assert manifest["documents_out"] == 2 and not manifest["dropped"]
    tokens, offsets = load_shard(out / "tokens", "preference")
    tokenizer = GLMTokenizer.from_file(out / "tokenizer.json")
    seq_len = int(pair_lengths(np.asarray(tokens), offsets, ChatTokens(tokenizer)).max())  # every pair fits
    data = PreferenceDataModule(str(out), seq_len=seq_len, batch_size=1, mixture={"preference": 1}, val_fraction=0)
    data.setup()
    assert data.dropped_overlong == {"train": 0, "val": 0}
    pairs = data.every_pair()["train"]["preference"]
    for item, (chosen, rejected, tools) in enumerate(conversations):
        sample = pairs.sample(0, item)
        for side, messages in (("chosen", chosen), ("rejected", rejected)):
            ids, mask, length = (sample[f"{side}_{key}"] for key in ("ids", "mask", "length"))
            assert tokenizer.decode(ids[:length].tolist()) == render_chat(messages, tools) + EOS
            reply = tokenizer.decode(ids[mask.astype(bool)].tolist())
            if tools:  # the call the prompt ends with opens the reply; its result is not the model's
                assert reply.startswith("\n<think></think>\n<tool_call>weather") and "sunny" not in reply
            assert reply.endswith(messages[-1]["content"] + EOS)
