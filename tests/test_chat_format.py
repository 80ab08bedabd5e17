"""GLM-4.6's chat format: render_chat (Python) and CHAT_TEMPLATE (the Jinja every export carries) against
GLM-4.6's own published template, on conversations with every kind of turn; the ids and the loss mask SFT trains."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from glm46.data.chat import CHAT_TEMPLATE, ChatTokens, assistant_mask, format_chat, render_chat, tool_arguments
from glm46.data.pipeline import prepare_dataset
from glm46.data.shards import load_shard
from glm46.data.tokenizer import GLMTokenizer, train_tokenizer
from glm46.hf import save_hf

from .helpers import random_model, tiny_config

# The `chat_template` of zai-org/GLM-4.6's tokenizer_config.json on the Hub, as llama.cpp keeps it
# (github.com/ggml-org/llama.cpp, models/templates/GLM-4.6.jinja, commit afefa651447358ae477f31a0ea1b97adff04c64f).
PUBLISHED_TEMPLATE = (
    "[gMASK]<sop>\n"
    "{%- if tools -%}\n"
    "<|system|>\n"
    "# Tools\n"
    "\n"
    "You may call one or more functions to assist with the user query.\n"
    "\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n"
    "{% for tool in tools %}\n"
    "{{ tool | tojson(ensure_ascii=False) }}\n"
    "{% endfor %}\n"
    "</tools>\n"
    "\n"
    "For each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}\n"
    "<arg_key>{arg-key-1}</arg_key>\n"
    "<arg_value>{arg-value-1}</arg_value>\n"
    "<arg_key>{arg-key-2}</arg_key>\n"
    "<arg_value>{arg-value-2}</arg_value>\n"
    "...\n"
    "</tool_call>{%- endif -%}\n"
    "{%- macro visible_text(content) -%}\n"
    "    {%- if content is string -%}\n"
    "        {{- content }}\n"
    "    {%- elif content is iterable and content is not mapping -%}\n"
    "        {%- for item in content -%}\n"
    "            {%- if item is mapping and item.type == 'text' -%}\n"
    "                {{- item.text }}\n"
    "            {%- elif item is string -%}\n"
    "                {{- item }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{- content }}\n"
    "    {%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{%- set ns = namespace(last_user_index=-1) %}\n"
    "{%- for m in messages %}\n"
    "    {%- if m.role == 'user' %}\n"
    "        {% set ns.last_user_index = loop.index0 -%}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{% for m in messages %}\n"
    "{%- if m.role == 'user' -%}<|user|>\n"
    "{{ visible_text(m.content) }}\n"
    "{{- '/nothink' if (enable_thinking is defined and not enable_thinking and not visible_text(m.content"
    ").endswith(\"/nothink\")) else '' -}}\n"
    "{%- elif m.role == 'assistant' -%}\n"
    "<|assistant|>\n"
    "{%- set reasoning_content = '' %}\n"
    "{%- set content = visible_text(m.content) %}\n"
    "{%- if m.reasoning_content is string %}\n"
    "    {%- set reasoning_content = m.reasoning_content %}\n"
    "{%- else %}\n"
    "    {%- if '</think>' in content %}\n"
    "        {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].l"
    "strip('\\n') %}\n"
    "        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- if loop.index0 > ns.last_user_index and reasoning_content -%}\n"
    "{{ '\\n<think>' + reasoning_content.strip() +  '</think>'}}\n"
    "{%- else -%}\n"
    "{{ '\\n<think></think>' }}\n"
    "{%- endif -%}\n"
    "{%- if content.strip() -%}\n"
    "{{ '\\n' + content.strip() }}\n"
    "{%- endif -%}\n"
    "{% if m.tool_calls %}\n"
    "{% for tc in m.tool_calls %}\n"
    "{%- if tc.function %}\n"
    "    {%- set tc = tc.function %}\n"
    "{%- endif %}\n"
    "{{ '\\n<tool_call>' + tc.name }}\n"
    "{% set _args = tc.arguments or {} %}\n"
    "{% for k, v in _args.items() %}\n"
    "<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>\n"
    "{% endfor %}\n"
    "</tool_call>{% endfor %}\n"
    "{% endif %}\n"
    "{%- elif m.role == 'tool' -%}\n"
    "{%- if m.content is string -%}\n"
    '{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}\n'
    "    {{- '<|observation|>' }}\n"
    "{%- endif %}\n"
    "{{- '\\n<tool_response>\\n' }}\n"
    "{{- m.content }}\n"
    "{{- '\\n</tool_response>' }}\n"
    "{%- else -%}\n"
    "<|observation|>{% for tr in m.content %}\n"
    "\n"
    "<tool_response>\n"
    "{{ tr.output if tr.output is defined else tr }}\n"
    "</tool_response>{% endfor -%}\n"
    "{% endif -%}\n"
    "{%- elif m.role == 'system' -%}\n"
    "<|system|>\n"
    "{{ visible_text(m.content) }}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    <|assistant|>{{- '\\n<think></think>' if (enable_thinking is defined and not enable_thinking) els"
    "e '' -}}\n"
    "{%- endif -%}\n"
)

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Évalue an arithmetic expression",  # non-ASCII: written as is (ensure_ascii=False)
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    },
}


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_CONVERSATION = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "What is 1234 * 56, and the weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two tools.",
        "tool_calls": [
            call("calculator", expression="1234 * 56"),
            call("weather", city="Zürich", days=3, options={"units": ["C"]}, exact=True, note=None),
        ],
    },
    {"role": "tool", "content": "69104"},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "<think>Both answered.</think>\n1234 * 56 = 69104; sunny.\nAnswer: 69104"},
]
CASES = {
    "user": ([{"role": "user", "content": "hi"}], None, {}),
    "system, user, assistant": (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ],
        None,
        {},
    ),
    "reasoning_content": (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "\nthink hard\n"},
        ],
        None,
        {},
    ),
    "inline think; reasoning dropped before the last user turn": (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "<think>\ninline\n</think>\n\nanswer"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "<think>second</think>ans2"},
        ],
        None,
        {},
    ),
    "tools, several calls with string and non-string arguments, several results": (
        TOOL_CONVERSATION,
        [CALCULATOR, WEATHER],
        {},
    ),
    "a call without arguments and results in one message": (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "I'll check.", "tool_calls": [{"name": "weather", "arguments": {}}]},
            {"role": "tool", "content": [{"output": "r1"}, "r2"]},
        ],
        [WEATHER],
        {},
    ),
    "tools and the generation prompt": (
        [{"role": "user", "content": "q"}],
        [CALCULATOR],
        {"add_generation_prompt": True},
    ),
    "enable_thinking=False": (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "<think>x</think>a"},
            {"role": "user", "content": "q2 /nothink"},
        ],
        None,
        {"add_generation_prompt": True, "enable_thinking": False},
    ),
    "enable_thinking=True": (
        [{"role": "user", "content": "q"}],
        None,
        {"add_generation_prompt": True, "enable_thinking": True},
    ),
    "content parts": (
        [
            {"role": "user", "content": [{"type": "text", "text": "part1 "}, {"type": "image"}, "part2"]},
            {"role": "assistant", "content": "  spaced  "},
        ],
        None,
        {},
    ),
}


def published(messages, tools=None, **options) -> str:
    """What transformers' apply_chat_template (and so vLLM and SGLang) renders with GLM-4.6's template."""
    return render_jinja_template([messages], tools=tools, chat_template=PUBLISHED_TEMPLATE, **options)[0][0]


@pytest.mark.parametrize("case", CASES)
def test_our_template_and_render_chat_render_as_glm46s_template(case):
    messages, tools, options = CASES[case]
    expected = published(messages, tools, **options)
    assert render_jinja_template([messages], tools=tools, chat_template=CHAT_TEMPLATE, **options)[0][0] == expected
    assert render_chat(messages, tools, **options) == expected


def test_the_tool_conversation_reads_as_glm_writes_it():
    text = render_chat(TOOL_CONVERSATION, [CALCULATOR, WEATHER])
    assert (
        text.startswith("[gMASK]<sop><|system|>\n# Tools\n") and '{"name": "calculator", "description": "Évalue' in text
    )
    assert text.endswith(
        "<|system|>\nUse the tools.<|user|>\nWhat is 1234 * 56, and the weather in Zürich?<|assistant|>"
        "\n<think>Two tools.</think>\n<tool_call>calculator\n<arg_key>expression</arg_key>"
        "\n<arg_value>1234 * 56</arg_value>\n</tool_call>\n<tool_call>weather\n<arg_key>city</arg_key>"
        "\n<arg_value>Zürich</arg_value>\n<arg_key>days</arg_key>"
        '\n<arg_value>3</arg_value>\n<arg_key>options</arg_key>\n<arg_value>{"units": ["C"]}</arg_value>'
        "\n<arg_key>exact</arg_key>\n<arg_value>true</arg_value>\n<arg_key>note</arg_key>\n<arg_value>null</arg_value>"
        "\n</tool_call><|observation|>\n<tool_response>\n69104\n</tool_response>\n<tool_response>\nsunny"
        "\n</tool_response><|assistant|>\n<think>Both answered.</think>\n1234 * 56 = 69104; sunny.\nAnswer: 69104"
    )


def test_openai_json_string_arguments_render_as_the_dict_they_hold():
    as_string = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1, "y": "z"}'}}],
        },
    ]
    as_dict = [as_string[0], {"role": "assistant", "content": "", "tool_calls": [call("f", x=1, y="z")]}]
    assert render_chat(as_string) == render_chat(as_dict) == published(as_dict)
    with pytest.raises(ValueError):
        tool_arguments({"arguments": "{not json"})
    with pytest.raises(TypeError, match="a list, not an object"):
        tool_arguments({"arguments": "[1, 2]"})


def test_an_unknown_role_is_refused_naming_the_message():
    with pytest.raises(ValueError, match="message 1: role 'observation' is not one of"):
        render_chat([{"role": "user", "content": "a"}, {"role": "observation", "content": "b"}])
    with pytest.raises(Exception, match="message 1: role observation is not one of"):
        render_jinja_template(
            [[{"role": "user", "content": "a"}, {"role": "observation", "content": "b"}]], chat_template=CHAT_TEMPLATE
        )


@pytest.fixture(scope="module")
def tokenizer():
    texts = [render_chat(messages, tools) for messages, tools, _ in CASES.values()] * 3
    return GLMTokenizer(train_tokenizer(texts, vocab_size=400))


def test_sft_ids_are_the_published_templates_tokens_and_the_mask_trains_what_the_model_writes(tokenizer):
    ids, mask = format_chat(TOOL_CONVERSATION, tokenizer, [CALCULATOR, WEATHER])
    eos = tokenizer.token_id("<|endoftext|>")
    assert ids == tokenizer.encode(published(TOOL_CONVERSATION, [CALCULATOR, WEATHER])) + [eos]
    assert assistant_mask(np.array(ids), ChatTokens(tokenizer)).tolist() == mask
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    # the reasoning (both turns follow the last user turn), content and tool calls after each <|assistant|>, and
    # the token that ends the turn:
    # <|observation|> after the calls, <|endoftext|> after the last reply; never the tools, system, user or results
    assert trained == (
        "\n<think>Two tools.</think>\n<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>1234 * 56"
        "</arg_value>\n</tool_call>\n<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Zürich</arg_value>\n<arg_key>days"
        '</arg_key>\n<arg_value>3</arg_value>\n<arg_key>options</arg_key>\n<arg_value>{"units": ["C"]}</arg_value>'
        "\n<arg_key>exact</arg_key>\n<arg_value>true</arg_value>\n<arg_key>note</arg_key>\n<arg_value>null</arg_value>"
        "\n</tool_call><|observation|>"
        "\n<think>Both answered.</think>\n1234 * 56 = 69104; sunny.\nAnswer: 69104<|endoftext|>"
    )
    untrained = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    assert "# Tools" in untrained and untrained.endswith(
        "<|system|>\nUse the tools.<|user|>\nWhat is 1234 * 56, and the weather in Zürich?<|assistant|>"
        "\n<tool_response>\n69104\n</tool_response>\n<tool_response>\nsunny\n</tool_response><|assistant|>"
    )


def test_the_chat_source_renders_conversations_and_counts_the_bad_ones_by_reason(tmp_path):
    good = [
        {"messages": TOOL_CONVERSATION, "tools": [CALCULATOR, WEATHER], "id": "tools"},
        {"messages": CASES["reasoning_content"][0]},
        {"messages": CASES["inline think; reasoning dropped before the last user turn"][0], "domain": "chat"},
    ]
    openai_call = {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2 + 2"}'}}
    bad = [
        ({"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]}, "chat/unknown_role"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [openai_call]}]},
            "chat/tool_call_without_tools",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "tool_calls": [{"function": {"name": "calculator", "arguments": "{2 + 2"}}]},
                ],
                "tools": [CALCULATOR],
            },
            "chat/arguments_not_json",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "4"}]},
            "chat/tool_result_without_call",
        ),
        ({"messages": []}, "malformed"),
        ({"text": "a document, not a conversation"}, "malformed"),
    ]
    lines = [json.dumps(record) for record in good[:2]] + [json.dumps(record) for record, _ in bad]
    lines += ["{not json", json.dumps(good[2])]
    (tmp_path / "conversations.jsonl").write_text("\n".join(lines) + "\n")
    manifest = prepare_dataset(
        "chat", [str(tmp_path / "conversations.jsonl")], tmp_path / "out", default_domain="sft", vocab_size=400
    )
    assert manifest["documents_in"] == len(lines) and manifest["documents_out"] == len(good)
    assert manifest["dropped"] == {
        "chat/unknown_role": 1,
        "chat/tool_call_without_tools": 1,
        "chat/arguments_not_json": 1,
        "chat/tool_result_without_call": 1,
        "malformed": 3,
    }
    where = str(tmp_path / "conversations.jsonl")
    assert manifest["examples"]["chat/unknown_role"] == [
        f"{where}:3: message 1: role 'robot' is not one of ['assistant', 'system', 'tool', 'user']"
    ]
    assert manifest["examples"]["chat/arguments_not_json"][0].startswith(f"{where}:5: message 1: calculator: ")
    tokenizer = GLMTokenizer.from_file(tmp_path / "out" / "tokenizer.json")
    for domain, records in (("sft", good[:2]), ("chat", good[2:])):
        tokens, offsets = load_shard(tmp_path / "out" / "tokens", domain)
        rendered = [tokenizer.decode(tokens[a:b].tolist()) for a, b in zip(offsets, offsets[1:])]
        expected = [render_chat(r["messages"], r.get("tools")) + "<|endoftext|>" for r in records]
        assert rendered == expected


def test_a_hub_tokenizer_is_used_as_it_is_by_sft_and_the_export(tmp_path, tokenizer):
    """A tokenizer in the Hub's layout (tokenizer.json + tokenizer_config.json with GLM-4.6's template, as
    zai-org/GLM-4.6 ships it; built here, no download): the SFT shards hold exactly what transformers' chat template
    gives with it, and the dataset and the export carry its tokenizer_config.json byte for byte."""
    hub = tmp_path / "GLM-4.6"
    hub.mkdir()
    tokenizer.save(hub / "tokenizer.json")
    hub_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 202752,
        "chat_template": PUBLISHED_TEMPLATE,
    }
    (hub / "tokenizer_config.json").write_text(json.dumps(hub_config, indent=2, ensure_ascii=False))
    records = [
        {"messages": TOOL_CONVERSATION, "tools": [CALCULATOR, WEATHER]},
        {"messages": CASES["reasoning_content"][0]},
    ]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    out = tmp_path / "out"
    prepare_dataset(
        "chat", [str(tmp_path / "chats.jsonl")], out, default_domain="sft", tokenizer_path=str(hub / "tokenizer.json")
    )
    assert (out / "tokenizer_config.json").read_bytes() == (hub / "tokenizer_config.json").read_bytes()

    hf = AutoTokenizer.from_pretrained(hub)
    tokens, offsets = load_shard(out / "tokens", "sft")
    for record, start, end in zip(records, offsets, offsets[1:]):
        ids = hf.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=True, return_dict=False)
        assert tokens[start:end].tolist() == ids + [hf.convert_tokens_to_ids("<|endoftext|>")]

    export = save_hf(
        random_model(tiny_config(vocab_size=tokenizer.vocab_size)),
        tmp_path / "hf",
        tokenizer=GLMTokenizer.from_file(out / "tokenizer.json"),
    )
    assert (export / "tokenizer_config.json").read_bytes() == (hub / "tokenizer_config.json").read_bytes()
    assert (export / "tokenizer.json").read_bytes() == (hub / "tokenizer.json").read_bytes()
