"""GLM-4.6's chat text back into messages: the inverse of glm46.data.chat.render_chat.

What a model writes is text in the chat format (a sampled reply, a tool episode); what `source=chat` reads and
other frameworks exchange is the OpenAI messages format. `parse_chat` reads a rendered conversation (a prompt and
what followed it, with or without the closing stop token) into `messages` and `tools`, so that

    render_chat(*parse_chat(text)) == text

for every text render_chat writes (tested on the embedded corpus), up to the whitespace the template strips around
an assistant turn's content. Text that no conversation renders to raises ValueError saying where: an assistant turn
without its `<think>` block, a tool call that does not parse, text after the tool calls of a turn, a tool result
outside `<tool_response>`, a turn before the first role token.
"""

from __future__ import annotations

import json
import re

from .chat import EOS, PREFIX, ROLE_TOKENS, TOOLS_FOOTER, TOOLS_HEADER, parse_tool_calls

_ROLES = {token: role for role, token in ROLE_TOKENS.items()}
_TURN = re.compile("(" + "|".join(re.escape(token) for token in ROLE_TOKENS.values()) + ")")
_RESPONSE = re.compile(r"\n<tool_response>\n(.*?)\n</tool_response>", re.S)
_THINK = re.compile(r"\n<think>(.*?)</think>", re.S)


def parse_chat(text: str) -> tuple[list[dict], list[dict] | None]:
    """Rendered chat text -> (messages, tools or None). A trailing <|endoftext|> is dropped; ValueError when the
    text is not a conversation in GLM-4.6's format."""
    text = text.removeprefix("".join(PREFIX)).removesuffix(EOS)
    tools = None
    if text.startswith(TOOLS_HEADER):
        block, found, text = text[len(TOOLS_HEADER) :].partition(TOOLS_FOOTER)
        if not found:
            raise ValueError("the tools block is not closed")
        try:
            tools = [json.loads(line) for line in block.splitlines() if line.strip()]
        except ValueError as error:
            raise ValueError(f"a tool schema is not JSON: {error}") from None
    head, *parts = _TURN.split(text)
    if head:
        raise ValueError(f"text before the first role token: {head[:60]!r}")
    messages: list[dict] = []
    for token, body in zip(parts[::2], parts[1::2]):
        role = _ROLES[token]
        if role == "assistant":
            messages.append(_assistant(body, tools, len(messages)))
        elif role == "tool":
            messages += _tool_results(body, len(messages))
        else:
            if not body.startswith("\n"):
                raise ValueError(f"message {len(messages)} ({role}): no newline after {token}")
            messages.append({"role": role, "content": body[1:]})
    return messages, tools


def _assistant(body: str, tools: list[dict] | None, number: int) -> dict:
    """One assistant turn: `\\n<think>reasoning</think>`, then `\\ncontent`, then its tool calls."""
    think = _THINK.match(body)
    if think is None:
        raise ValueError(f"message {number} (assistant): no <think></think> block after <|assistant|>")
    rest = body[think.end() :]
    content, opens, calls = rest.partition("\n<tool_call>")
    message = {"role": "assistant", "content": content.strip()}
    if think.group(1).strip():
        message["reasoning_content"] = think.group(1).strip()
    if opens:
        calls = opens.lstrip("\n") + calls
        if not calls.endswith("</tool_call>") or re.sub(r"<tool_call>.*?</tool_call>", "", calls, flags=re.S).strip():
            raise ValueError(f"message {number} (assistant): text after its tool calls: {calls[-60:]!r}")
        try:
            parsed = parse_tool_calls(calls, tools)
        except ValueError as error:
            raise ValueError(f"message {number} (assistant): {error}") from None
        message["tool_calls"] = [{"type": "function", "function": call} for call in parsed]
    return message


def _tool_results(body: str, number: int) -> list[dict]:
    """The results after one <|observation|>: one tool message each, as render_chat writes consecutive results."""
    results = _RESPONSE.findall(body)
    if _RESPONSE.sub("", body) or not results:
        raise ValueError(f"message {number} (tool): text outside <tool_response>: {body[:60]!r}")
    return [{"role": "tool", "content": result} for result in results]
