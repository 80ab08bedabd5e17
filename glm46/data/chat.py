"""GLM-4.6's chat format: the text its published chat template renders (the `chat_template` of
zai-org/GLM-4.6's tokenizer_config.json on the Hub), and the loss mask GLM's SFT trains on it.

    [gMASK]<sop><|system|>\\n# Tools ... <tools>\\n{tool JSON}\\n</tools> ...    (only with a tools list)
    <|system|>\\n{system}<|user|>\\n{question}[/nothink]
    <|assistant|>\\n<think>{reasoning}</think>\\n{content}\\n<tool_call>{name}\\n<arg_key>{k}</arg_key>\\n<arg_value>{v}</arg_value>\\n</tool_call>
    <|observation|>\\n<tool_response>\\n{result}\\n</tool_response>\\n<tool_response>\\n...</tool_response>
    <|assistant|>\\n<think></think>\\n{answer}

An assistant turn's reasoning is its `reasoning_content`, or the `<think>...</think>` at the start of its content;
only the turns after the last user message keep it (earlier ones render an empty `<think></think>`). A tool
call's string arguments are written as they are, others as JSON. `enable_thinking=False` appends `/nothink` to
each user turn and an empty think block after the generation prompt. `render_chat` writes this text in Python
and CHAT_TEMPLATE in Jinja (for tokenizer_config.json: transformers' apply_chat_template, vLLM's and SGLang's
chat endpoints); both are tested equal to GLM-4.6's own template on every case above. One difference, on
purpose: a `null` content renders as nothing (GLM-4.6's template writes `None`).

The loss mask (`assistant_mask`) is 1 on what the model writes: everything after each `<|assistant|>` (the
reasoning, the content, the tool calls) and the token that ends the turn (`<|observation|>` after a tool call,
the next role token, or <|endoftext|> at the end; GLM-4.6 stops generating at <|user|>, <|observation|> or
<|endoftext|>); never the system, user or tool-result tokens. A prompt ends at `<|assistant|>` (glm46.rl.prompts,
the eval tasks), so the newline after it is the first token the model generates: it is trained too.

Chat documents are stored as their rendered text, so deduplication, quality rules, tokenizer training and token
shards see exactly what the model sees; `assistant_mask` recovers the loss mask from the ids alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from .tokenizer import GLMTokenizer

ROLE_TOKENS = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|observation|>",  # a tool result follows <|observation|>
}
PREFIX = ("[gMASK]", "<sop>")
EOS = "<|endoftext|>"
NOTHINK = "/nothink"
STOP_TOKENS = (EOS, ROLE_TOKENS["user"], ROLE_TOKENS["tool"])  # where GLM ends a reply
TOOLS_HEADER = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FOOTER = (
    "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
    "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>"
)


def _jinja(text: str) -> str:
    """A Python string as a Jinja string literal (newlines escaped, so the template stays readable as JSON)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


# render_chat in Jinja, each tag trimming the whitespace around it, so the output is the same whatever the engine's
# trim_blocks / lstrip_blocks settings.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- macro visible_text(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is none -%}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for item in content -%}"
    "{%- if item is mapping and item.type == 'text' -%}{{- item.text -}}"
    "{%- elif item is string -%}{{- item -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{{- content -}}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set nothink = enable_thinking is defined and not enable_thinking -%}"
    "{%- if tools -%}"
    "{{- " + _jinja(TOOLS_HEADER) + " -}}"
    "{%- for tool in tools -%}{{- tool | tojson(ensure_ascii=False) -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- " + _jinja(TOOLS_FOOTER) + " -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}"
    "{%- set text = visible_text(m.content) -%}"
    "{{- '<|user|>\\n' ~ text -}}"
    "{%- if nothink and not text.endswith('/nothink') -%}{{- '/nothink' -}}{%- endif -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = visible_text(m.content) -%}"
    "{%- set reasoning = '' -%}"
    "{%- if m.reasoning_content is string -%}{%- set reasoning = m.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|assistant|>' -}}"
    "{%- if loop.index0 > ns.last_user and reasoning -%}{{- '\\n<think>' ~ reasoning.strip() ~ '</think>' -}}"
    "{%- else -%}{{- '\\n<think></think>' -}}{%- endif -%}"
    "{%- if content.strip() -%}{{- '\\n' ~ content.strip() -}}{%- endif -%}"
    "{%- for tool_call in m.tool_calls or [] -%}"
    "{%- set function = tool_call.function if tool_call.function else tool_call -%}"
    "{{- '\\n<tool_call>' ~ function.name ~ '\\n' -}}"
    "{%- for key, value in (function.arguments or {}).items() -%}"
    "{{- '<arg_key>' ~ key ~ '</arg_key>\\n<arg_value>' -}}"
    "{%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson(ensure_ascii=False) -}}{%- endif -%}"
    "{{- '</arg_value>\\n' -}}"
    "{%- endfor -%}"
    "{{- '</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if m.content is string -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' ~ m.content ~ '\\n</tool_response>' -}}"
    "{%- else -%}"
    "{{- '<|observation|>' -}}"
    "{%- for result in m.content -%}"
    "{{- '\\n<tool_response>\\n' ~ (result.output if result.output is defined else result) ~ '\\n</tool_response>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- elif m.role == 'system' -%}"
    "{{- '<|system|>\\n' ~ visible_text(m.content) -}}"
    "{%- else -%}"
    "{{- raise_exception('message ' ~ loop.index0 ~ ': role ' ~ m.role ~ ' is not one of "
    "[assistant, system, tool, user]') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}"
    "{%- if nothink -%}{{- '\\n<think></think>' -}}{%- endif -%}"
    "{%- endif -%}"
)


def _check_role(number: int, role: str) -> str:
    if role not in ROLE_TOKENS:
        raise ValueError(f"message {number}: role {role!r} is not one of {sorted(ROLE_TOKENS)}")
    return role


def visible_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of parts (OpenAI's `[{"type": "text", ...}]`)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(
            item["text"] if isinstance(item, dict) and item.get("type") == "text" else item
            for item in content
            if isinstance(item, str) or (isinstance(item, dict) and item.get("type") == "text")
        )
    return str(content)


def tool_arguments(function: dict) -> dict:
    """A tool call's arguments as a dict: the Hub's convention, or OpenAI's JSON string (json.JSONDecodeError or
    TypeError when it is not a JSON object)."""
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise TypeError(f"arguments are a {type(arguments).__name__}, not an object")
    return arguments


def _argument(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _tool_call(call: dict) -> str:
    function = call.get("function") or call
    arguments = "".join(
        f"<arg_key>{key}</arg_key>\n<arg_value>{_argument(value)}</arg_value>\n"
        for key, value in tool_arguments(function).items()
    )
    return f"\n<tool_call>{function['name']}\n{arguments}</tool_call>"


def _assistant_turn(message: dict, keeps_reasoning: bool) -> str:
    content, reasoning = visible_text(message.get("content")), message.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    think = f"\n<think>{reasoning.strip()}</think>" if keeps_reasoning and reasoning else "\n<think></think>"
    text = f"\n{content.strip()}" if content.strip() else ""
    return "<|assistant|>" + think + text + "".join(_tool_call(call) for call in message.get("tool_calls") or [])


def tool_responses(results: list) -> str:
    """Tool results as the template writes them after <|observation|>, one block each."""
    return "".join(f"\n<tool_response>\n{result}\n</tool_response>" for result in results)


def _tool_result(messages: list[dict], number: int) -> str:
    content = messages[number].get("content")
    if isinstance(content, list):  # several results in one message
        results = [item["output"] if isinstance(item, dict) and "output" in item else item for item in content]
        return "<|observation|>" + tool_responses(results)
    opens = number == 0 or messages[number - 1]["role"] != "tool"
    return ("<|observation|>" if opens else "") + tool_responses([visible_text(content)])


def conversation_problem(messages: Any, tools: Any = None) -> tuple[str, str] | None:
    """Why a conversation in the OpenAI messages format (`messages`, optional `tools`) cannot be trained on:
    (reason, detail), or None. Reasons: malformed, unknown_role, tool_call_without_tools, arguments_not_json,
    tool_result_without_call."""
    if not isinstance(messages, list) or not messages:
        return "malformed", "field 'messages' is not a non-empty array"
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        return "malformed", "field 'tools' is not an array of objects"
    calls_before = False  # whether the turn before a tool result is an assistant's call
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return "malformed", f"message {number} is not an object with a string 'role'"
        role, content = message["role"], message.get("content")
        if role not in ROLE_TOKENS:
            return "unknown_role", f"message {number}: role {role!r} is not one of {sorted(ROLE_TOKENS)}"
        if content is not None and not isinstance(content, (str, list)):
            return "malformed", f"message {number}: content is a {type(content).__name__}, not text or parts"
        if role == "tool":
            if not calls_before:
                return "tool_result_without_call", f"message {number}: a tool result, and no assistant call before it"
            continue
        calls = message.get("tool_calls") if role == "assistant" else None
        calls_before = bool(calls)
        for call in calls or []:
            function = (call.get("function") or call) if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                return "malformed", f"message {number}: a tool call without a function name"
            if not tools:
                return "tool_call_without_tools", f"message {number} calls {function['name']}, and no tools are listed"
            try:
                tool_arguments(function)
            except (ValueError, TypeError) as error:
                return "arguments_not_json", f"message {number}: {function['name']}: {error}"
    return None


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.S)


def parse_tool_calls(text: str, tools: list[dict] | None = None) -> list[dict]:
    """The tool calls in an assistant turn written in GLM's format -> [{"name", "arguments"}], in order (none: []).
    A value is kept as written where the tool's schema declares a string, else read as JSON when it is JSON (the
    template writes non-strings as JSON), as vLLM's glm45 parser reads them. ValueError: a call that does not parse
    (unclosed, without a name, with text that is no argument)."""
    if text.count("<tool_call>") != text.count("</tool_call>") or text.count("<tool_call>") != len(
        _TOOL_CALL.findall(text)
    ):
        raise ValueError("a <tool_call> is not closed")
    strings = {
        (tool.get("function") or tool)["name"]: {
            key
            for key, spec in (tool.get("function") or tool).get("parameters", {}).get("properties", {}).items()
            if spec.get("type") == "string"
        }
        for tool in tools or []
    }
    calls = []
    for body in _TOOL_CALL.findall(text):
        head, opens, rest = body.partition("<arg_key>")
        name, _, stray = head.strip().partition("\n")
        rest = opens + rest
        if not name or any(c.isspace() for c in name):
            raise ValueError(f"a tool call without a name: {body[:60]!r}")
        if stray.strip() or _ARGUMENT.sub("", rest).strip():
            raise ValueError(f"{name}: text that is no <arg_key>/<arg_value> pair: {(stray or rest)[:60]!r}")
        arguments = {}
        for key, value in _ARGUMENT.findall(rest):
            arguments[key.strip()] = value if key.strip() in strings.get(name, ()) else _json_or_text(value)
        calls.append({"name": name, "arguments": arguments})
    return calls


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


def render_chat(
    messages: list[dict],
    tools: list[dict] | None = None,
    *,
    add_generation_prompt: bool = False,
    enable_thinking: bool | None = None,
) -> str:
    """messages in the Hub's format ({"role", "content"}, assistant `reasoning_content` and `tool_calls`; role
    `tool` for a result) and the tools' JSON schemas -> the text GLM-4.6's template renders. The shard writer
    appends <|endoftext|> to it; `add_generation_prompt` ends it where a model starts its reply."""
    parts = ["".join(PREFIX)]
    if tools:
        parts += [TOOLS_HEADER, *(json.dumps(tool, ensure_ascii=False) + "\n" for tool in tools), TOOLS_FOOTER]
    last_user = max((n for n, m in enumerate(messages) if m["role"] == "user"), default=-1)
    for number, message in enumerate(messages):
        role = _check_role(number, message["role"])
        if role == "user":
            text = visible_text(message.get("content"))
            parts.append(
                f"<|user|>\n{text}" + (NOTHINK if enable_thinking is False and not text.endswith(NOTHINK) else "")
            )
        elif role == "assistant":
            parts.append(_assistant_turn(message, keeps_reasoning=number > last_user))
        elif role == "tool":
            parts.append(_tool_result(messages, number))
        else:
            parts.append(f"<|system|>\n{visible_text(message.get('content'))}")
    if add_generation_prompt:
        parts.append("<|assistant|>" + ("\n<think></think>" if enable_thinking is False else ""))
    return "".join(parts)


class ChatTokens:
    """The special-token ids the chat format uses, from a tokenizer, and a per-id table of their kinds."""

    BOUNDARY, ASSISTANT = 1, 2

    def __init__(self, tokenizer: GLMTokenizer):
        self.assistant = tokenizer.token_id(ROLE_TOKENS["assistant"])
        self.user = tokenizer.token_id(ROLE_TOKENS["user"])
        self.tool_call = tokenizer.tokenizer.token_to_id("<tool_call>")  # None in a tokenizer without tools
        self.eos = tokenizer.token_id(EOS)
        self.gmask = tokenizer.token_id(PREFIX[0])
        boundaries = [tokenizer.token_id(t) for t in ROLE_TOKENS.values()] + [self.eos, self.gmask]
        self.kind = np.zeros(max(tokenizer.vocab_size, *boundaries) + 1, dtype=np.int8)  # 0: any other token
        self.kind[boundaries] = self.BOUNDARY
        self.kind[self.assistant] = self.ASSISTANT


def reply_starts(tokens: np.ndarray, chat: ChatTokens) -> np.ndarray:
    """Positions just after each `<|assistant|>` that opens the reply to a user turn (the first after each
    <|user|>): where an episode starts. The later ones of a reply (after tool results) belong to it."""
    tokens = np.asarray(tokens)
    assistants = np.flatnonzero(tokens == chat.assistant)
    users = np.flatnonzero(tokens == chat.user)
    opening = np.searchsorted(assistants, users, side="right")  # the first <|assistant|> after each <|user|>
    return np.unique(assistants[opening[opening < len(assistants)]]) + 1


def reply_span(ids: np.ndarray, chat: ChatTokens) -> tuple[int, int]:
    """(where the reply to the last user turn starts, where its last assistant turn starts) in one conversation: a
    prompt ends at the first; the reference's final answer is in the turn from the second (they differ in a reply
    that calls tools)."""
    ids = np.asarray(ids)
    return int(reply_starts(ids, chat)[-1]), int(np.flatnonzero(ids == chat.assistant)[-1]) + 1


def assistant_mask(ids: np.ndarray, chat: ChatTokens) -> np.ndarray:
    """The loss mask, from ids alone (uint8, the length of `ids`): 1 on the tokens of an assistant turn after its
    role token (the newline included), and on the role token or <|endoftext|> that closes it. `ids` may hold
    several conversations end to end; it should start at a conversation's start."""
    kind = chat.kind[np.asarray(ids)]
    boundary = kind > 0  # a role token, <|endoftext|> or [gMASK]: a turn starts or ends here
    index = np.arange(len(kind))
    previous = np.empty_like(index)  # the newest boundary strictly before i (-1: none)
    previous[:1] = -1
    np.maximum.accumulate(np.where(boundary, index, -1)[:-1], out=previous[1:])
    in_reply = np.where(previous >= 0, kind[previous], 0) == ChatTokens.ASSISTANT
    return in_reply.astype(np.uint8)  # boundaries in a reply close it: trained too


def format_chat(messages: list[dict], tokenizer: GLMTokenizer, tools: list[dict] | None = None) -> tuple[list, list]:
    """A conversation as SFT trains it: (the ids of render_chat's text and <|endoftext|>, the loss mask)."""
    ids = tokenizer.encode(render_chat(messages, tools)) + [tokenizer.token_id(EOS)]
    return ids, assistant_mask(np.array(ids), ChatTokens(tokenizer)).tolist()
