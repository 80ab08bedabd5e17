"""Conversations as `source=chat` reads them (read_chat): the layouts chat data comes in, each converted to the
OpenAI messages format glm46.data.chat renders.
`conversation(record)` takes the first layout that fits a record, in this order:

    1. OpenAI messages   {"messages": [{"role": "user", "content": "Hi"}, ...], "tools": [...]}
    2. ShareGPT          {"conversations": [{"from": "human", "value": "Hi"}, ...], "system": ..., "tools": ...}
    3. Alpaca            {"instruction": "Sum", "input": "2 2", "output": "4", "system": ..., "history": [[q, a]]}
    4. prompt-completion {"prompt": "Hi" | [messages], "completion": "Hello" | [messages], "tools": [...]}

1. A `messages` list whose turns hold no `from`: as it is, with its `tools`.
2. A `conversations` list, or a `messages` list whose turns hold `from` (LLaMA-Factory's `sharegpt`). `from`:
   human or user -> a user turn; gpt, assistant or model -> an assistant turn; system; function_call or tool_call
   -> an assistant turn calling tools, the value the JSON of a call {"name", "arguments"} or of a list of calls;
   observation or tool -> a tool result. A top-level `system` opens the conversation.
3. `instruction` (LLaMA-Factory's `alpaca`): the user turn is the instruction, with `input` after a newline where
   there is one (LLaMA-Factory joins them so), the assistant turn `output`; `history`'s [user, assistant] pairs
   come before them, a `system` first.
4. `prompt` and `completion` (TRL's prompt-completion): each a string (one user turn, one assistant turn) or
   messages; the conversation is the prompt, then the completion.

In the layouts other than OpenAI's, `tools` is a list or a JSON string of one (LLaMA-Factory's column), and a bare
function schema ({"name", "parameters"}) is written in OpenAI's form ({"type": "function", "function": {...}}), as a
chat endpoint hands tools to the template. A record none of the layouts fits raises FormatProblem (`malformed`,
naming its fields and the layouts); so does a ShareGPT turn with an unknown `from` (`unknown_role`) and a function
call that is no JSON (`arguments_not_json`) or no call (`malformed`). The messages themselves are checked after, as
any conversation's (glm46.data.chat.conversation_problem).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from .chat import conversation_problem, render_chat
from .documents import Document, Ledger
from .sources import admit_record, domain_problem, json_kind, jsonl_records

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "function_call": "call",  # an assistant turn calling tools
    "tool_call": "call",
    "observation": "tool",
    "tool": "tool",
}
ALPACA_JOIN = "\n"  # between instruction and input: LLaMA-Factory's AlpacaDatasetConverter ("prompt\nquery")
LAYOUTS = (
    "'messages' (OpenAI), 'conversations' (ShareGPT), 'instruction' + 'output' (Alpaca), 'prompt' + 'completion' (TRL)"
)


class FormatProblem(ValueError):
    """A record that converts to no conversation: its reason (as conversation_problem's) and a detail."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def conversation(record: Any) -> tuple[Any, Any]:
    """A record in any of the layouts -> (OpenAI messages, tools or None), unchecked beyond the layout."""
    if not isinstance(record, dict):
        raise FormatProblem("malformed", f"{json_kind(record)}, not an object holding {LAYOUTS}")
    if "messages" in record and not _is_sharegpt(record["messages"]):
        return record["messages"], record.get("tools")
    if "messages" in record or "conversations" in record:
        return sharegpt(record)
    if "instruction" in record:
        return alpaca(record)
    if "prompt" in record and "completion" in record:
        return prompt_completion(record)
    fields = ", ".join(map(str, list(record)[:10])) or "none"
    raise FormatProblem("malformed", f"no conversation (fields: {fields}; accepted: {LAYOUTS})")


def _is_sharegpt(turns: Any) -> bool:
    return isinstance(turns, list) and any(isinstance(turn, dict) and "from" in turn for turn in turns)


def _text(record: dict, field: str) -> str:
    """An optional string field ("" when absent or null)."""
    value = record.get(field)
    if value is not None and not isinstance(value, str):
        raise FormatProblem("malformed", f"field {field!r} is {json_kind(value)}, not a string")
    return value or ""


def _system(record: dict) -> list[dict]:
    system = _text(record, "system")
    return [{"role": "system", "content": system}] if system else []


def tools_field(record: dict) -> Any:
    """`tools` as a list (a JSON string read), bare function schemas in OpenAI's form; None when absent."""
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except ValueError as error:
            raise FormatProblem("malformed", f"field 'tools' is a string that is no JSON ({error})") from None
    if not isinstance(tools, list):
        return tools  # None, or what conversation_problem names
    return [
        {"type": "function", "function": tool} if isinstance(tool, dict) and "function" not in tool else tool
        for tool in tools
    ]


def sharegpt(record: dict) -> tuple[list, Any]:
    """ShareGPT's {"conversations" (or "messages"): [{"from", "value"}], "system", "tools"}."""
    turns = record.get("messages", record.get("conversations"))
    if not isinstance(turns, list):
        raise FormatProblem("malformed", f"field 'conversations' is {json_kind(turns)}, not an array of turns")
    messages = [_sharegpt_message(number, turn) for number, turn in enumerate(turns)]
    return _system(record) + messages, tools_field(record)


def _sharegpt_message(number: int, turn: Any) -> dict:
    if not isinstance(turn, dict) or not isinstance(turn.get("from"), str):
        raise FormatProblem("malformed", f"turn {number} is not an object with a string 'from'")
    role = SHAREGPT_ROLES.get(turn["from"])
    if role is None:
        known = sorted(SHAREGPT_ROLES)
        raise FormatProblem("unknown_role", f"turn {number}: from {turn['from']!r} is not one of {known}")
    if role == "call":
        return {"role": "assistant", "content": "", "tool_calls": _tool_calls(number, turn.get("value"))}
    return {"role": role, "content": turn.get("value")}


def _tool_calls(number: int, value: Any) -> list[dict]:
    """A function_call turn's value -> OpenAI tool calls: JSON of {"name", "arguments"} or of a list of them."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            detail = f"turn {number}: a function call that is no JSON ({error})"
            raise FormatProblem("arguments_not_json", detail) from None
    calls = value if isinstance(value, list) else [value]
    if not calls or not all(isinstance(call, dict) and isinstance(call.get("name"), str) for call in calls):
        raise FormatProblem("malformed", f"turn {number}: a function call that is no {{'name', 'arguments'}} object")
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments") or {}}} for c in calls]


def alpaca(record: dict) -> tuple[list, Any]:
    """Alpaca's {"instruction", "input", "output", "system", "history": [[user, assistant], ...]}."""
    instruction, given, output = _text(record, "instruction"), _text(record, "input"), record.get("output")
    if not isinstance(output, str):
        raise FormatProblem("malformed", f"an Alpaca record whose 'output' is {json_kind(output)}, not a string")
    history = record.get("history") or []
    if not isinstance(history, list) or not all(
        isinstance(pair, list) and len(pair) == 2 and all(isinstance(text, str) for text in pair) for pair in history
    ):
        raise FormatProblem("malformed", "field 'history' is not an array of [user, assistant] string pairs")
    messages = _system(record)
    for user, assistant in history:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    query = ALPACA_JOIN.join(text for text in (instruction, given) if text)
    messages += [{"role": "user", "content": query}, {"role": "assistant", "content": output}]
    return messages, tools_field(record)


def prompt_completion(record: dict) -> tuple[list, Any]:
    """TRL's prompt-completion {"prompt", "completion", "tools"}: strings or messages."""
    parts = []
    for field, role in (("prompt", "user"), ("completion", "assistant")):
        value = record[field]
        if not isinstance(value, (str, list)):
            raise FormatProblem("malformed", f"field {field!r} is {json_kind(value)}, not a string or messages")
        parts += [{"role": role, "content": value}] if isinstance(value, str) else value
    return parts, tools_field(record)


def read_chat(paths: list[str], ledger: Ledger, default_domain: str = "sft") -> Iterator[Document]:
    """Conversations as JSONL, one per line: OpenAI messages {"messages": [...], optional "tools", "id", "domain"},
    or ShareGPT, Alpaca or prompt-completion records (glm46.data.chat_formats: how each is detected), each rendered
    in GLM-4.6's chat format (glm46.data.chat). A conversation that cannot be trained on is counted under
    chat/<reason> (glm46.data.chat.conversation_problem) at its file and line."""
    for record, where, nbytes in jsonl_records(paths, ledger):
        try:
            messages, tools = conversation(record)
            problem = conversation_problem(messages, tools)
        except FormatProblem as error:
            problem = error.reason, error.detail
        if problem is None and (domain := domain_problem(record)):
            problem = ("malformed", domain)
        if problem:
            reason, detail = problem
            ledger.reject(reason if reason == "malformed" else f"chat/{reason}", where, detail, nbytes)
            continue
        text = render_chat(messages, tools)
        doc = admit_record(text, "the conversation", record, where, ledger, default_domain, nbytes)
        if doc is not None:
            yield doc
