"""Preference pairs, one JSONL line each, as documents of the preparation: TRL's preference format, its prompt
explicit or implicit (TRL's implicit prompt; HH: Anthropic HH's layout):

    {"prompt": "...", "chosen": "...", "rejected": "..."}                                  (standard)
    {"prompt": [{"role": "user", "content": ...}, ...],
     "chosen": [{"role": "assistant", "content": ...}], "rejected": [...], "tools": [...]}   (conversational)
    {"chosen": [the whole conversation], "rejected": [the whole conversation]}             (implicit prompt)
    {"chosen": "\\n\\nHuman: ...\\n\\nAssistant: ...", "rejected": "\\n\\nHuman: ...\\n\\nAssistant: ..."}    (HH)

A string prompt is one user turn, a string side one assistant turn. Without a prompt (none, or an empty one) each
side is its whole conversation, messages or HH text (cut into turns at its "\\n\\nHuman:" and "\\n\\nAssistant:"
markers): the prompt is the longest run of whole messages both sides open with, each side's reply the rest.

A reply is one assistant turn, or one tool-using sequence (an assistant turn calling tools, their results, ...,
ending in an assistant turn), after a prompt that ends with a user turn or with tool results. Each side is rendered
after the prompt in GLM-4.6's chat format (glm46.data.chat), and a pair is ONE document: the chosen conversation,
then the rejected reply alone (the prompt is stored once):

    [gMASK]<sop>{prompt}<|assistant|>{chosen reply}<|endoftext|><|assistant|>{rejected reply}

(the shard writer appends the last <|endoftext|>), so that a pair is counted, kept or dropped whole and the
tokenizer trains on what the models read; glm46.lit.preference_data rebuilds the rejected conversation as the
prompt's tokens and the tokens after the first <|endoftext|>, the prompt ending at the reply to the last user turn:
a prompt's closing tool calls and results are stored as the opening of both replies (the same conversations; DPO's
log-probs of those shared tokens cancel, a reward model scores the end). Exact deduplication compares the prompt
(`Document.key`): a prompt keeps its first pair. The quality rules judge the document as any other.

A line that cannot be a pair is counted at its file:line under its reason: `malformed` (bad JSON, not an object,
a message that is no message), `preference/no_prompt` (no prompt, and sides that open with different messages or
an HH text without its markers; a prompt without a user turn), `preference/missing_side` (no `chosen` or no
`rejected`, an empty one, or an implicit side that is all prompt), `preference/identical` (both sides the same),
`preference/prompt_ends_with_assistant` and `preference/prompt_ends_with_system` (no user turn or tool result before
the reply), `preference/reply_not_assistant` (a side that does not open with an assistant turn),
`preference/side_has_user_turn` and `preference/side_has_system_turn` (a side that is more than one reply),
`preference/reply_ends_with_tool` (a side ending with a tool result, not an answer), and the conversation's own
(`chat/unknown_role`, ...: glm46.data.chat.conversation_problem).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from .chat import EOS, conversation_problem, render_chat
from .documents import Document, Ledger, normalized
from .sources import admit_record, domain_problem, json_kind, jsonl_records

SIDES = ("chosen", "rejected")
REPLY_ROLES = ("assistant", "tool")  # the turns a reply holds
HH_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant):")  # Anthropic HH's turn markers
HH_ROLES = {"Human": "user", "Assistant": "assistant"}


class PairProblem(ValueError):
    """A record that is no preference pair: its ledger reason and a detail."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def as_messages(value: Any, role: str) -> Any:
    """A string as one message of `role`; a list as it is (checked by conversation_problem)."""
    return [{"role": role, "content": value}] if isinstance(value, str) else value


def _empty(value: Any) -> bool:
    return value is None or (
        isinstance(value, (str, list)) and not (value.strip() if isinstance(value, str) else value)
    )


def hh_messages(text: str, side: str) -> list[dict]:
    """Anthropic HH's "\\n\\nHuman: ...\\n\\nAssistant: ..." text -> its messages."""
    parts = HH_TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise PairProblem(
            "preference/no_prompt",
            f"no prompt, and {side} is neither messages nor HH text (\\n\\nHuman: ...\\n\\nAssistant: ...)",
        )
    return [{"role": HH_ROLES[name], "content": text.strip()} for name, text in zip(parts[1::2], parts[2::2])]


def implicit_pair(record: dict) -> tuple[list, list, list]:
    """(prompt, chosen reply, rejected reply) of a pair without a prompt, each side its whole conversation: the
    messages both open with, and what follows them."""
    chosen, rejected = (hh_messages(record[s], s) if isinstance(record[s], str) else record[s] for s in SIDES)
    if chosen == rejected:
        raise PairProblem("preference/identical", "chosen and rejected are the same conversation")
    shared = next((n for n, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
    if not shared:
        raise PairProblem("preference/no_prompt", "no prompt, and chosen and rejected open with different messages")
    for side, messages in zip(SIDES, (chosen, rejected)):
        if len(messages) == shared:
            raise PairProblem("preference/missing_side", f"{side} holds nothing after the messages both open with")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def reply_start(prompt: list[dict]) -> int:
    """Where a prompt's closing tool-using turns (assistant calls and their results) start: the reply opens there,
    after the last user turn; len(prompt) when the prompt does not end with a tool result."""
    start = len(prompt)
    if prompt[-1]["role"] == "tool":
        while start and prompt[start - 1]["role"] in REPLY_ROLES:
            start -= 1
    return start


def _check_reply(side: str, reply: list[dict]) -> None:
    """A reply is one assistant turn, or assistant turns and tool results ending in an assistant turn."""
    if reply[0]["role"] != "assistant":
        raise PairProblem("preference/reply_not_assistant", f"{side} opens with a {reply[0]['role']!r} turn")
    for number, message in enumerate(reply):
        if message["role"] not in REPLY_ROLES:
            raise PairProblem(
                f"preference/side_has_{message['role']}_turn",
                f"{side}: reply message {number} is a {message['role']!r} turn (a side is one reply)",
            )
    if reply[-1]["role"] != "assistant":
        raise PairProblem("preference/reply_ends_with_tool", f"{side} ends with a tool result, not an answer")


def pair_turns(record: Any) -> tuple[list, list, list]:
    """(prompt, chosen reply, rejected reply) of a record, as messages that make a pair; PairProblem if they do not."""
    if not isinstance(record, dict):
        raise PairProblem("malformed", f"{json_kind(record)}, not an object with fields 'chosen' and 'rejected'")
    missing = [side for side in SIDES if _empty(record.get(side))]
    if missing:
        raise PairProblem("preference/missing_side", f"no {' and no '.join(repr(side) for side in missing)}")
    explicit = not _empty(record.get("prompt"))
    for field in ("prompt", *SIDES) if explicit else SIDES:
        if not isinstance(record[field], (str, list)):
            kind = json_kind(record[field])
            raise PairProblem("malformed", f"field {field!r} is {kind}, not a string or a list of messages")
    if explicit:
        prompt = as_messages(record["prompt"], "user")
        chosen, rejected = (as_messages(record[side], "assistant") for side in SIDES)
    else:
        prompt, chosen, rejected = implicit_pair(record)
    for side, reply in zip(SIDES, (chosen, rejected)):
        if problem := conversation_problem(prompt + reply, record.get("tools")):
            reason, detail = problem
            raise PairProblem(reason if reason == "malformed" else f"chat/{reason}", f"{side}: {detail}")
    start = reply_start(prompt)
    if not start:
        raise PairProblem("preference/no_prompt", "the prompt holds tool calls and results, and no user turn")
    if (last := prompt[start - 1]["role"]) != "user":
        detail = f"the prompt's last turn is {last!r}, not a user turn or tool results"
        raise PairProblem(f"preference/prompt_ends_with_{last}", detail)
    for side, reply in zip(SIDES, (chosen, rejected)):
        _check_reply(side, prompt[start:] + reply)
    if (domain := domain_problem(record)) is not None:
        raise PairProblem("malformed", domain)
    return prompt, chosen, rejected


def pair_text(record: Any) -> tuple[str, str]:
    """(the pair's document text, its prompt as rendered: the deduplication key) of a record; PairProblem for a
    record that is no pair. The document's prompt ends at its last user turn (pair_turns checked that it is there:
    render_chat renders such a prompt the same whatever follows it)."""
    prompt, *replies = pair_turns(record)
    tools, start = record.get("tools"), reply_start(prompt)
    head = render_chat(prompt[:start], tools)
    chosen, rejected = (render_chat(prompt + reply, tools) for reply in replies)
    if normalized(chosen.removeprefix(head)) == normalized(rejected.removeprefix(head)):
        raise PairProblem("preference/identical", "chosen and rejected render the same")
    key = head if start == len(prompt) else render_chat(prompt, tools)
    return f"{chosen}{EOS}{rejected.removeprefix(head)}", key


def read_preference(paths: list[str], ledger: Ledger, default_domain: str = "preference") -> Iterator[Document]:
    for record, where, nbytes in jsonl_records(paths, ledger):
        try:
            text, key = pair_text(record)
        except PairProblem as problem:
            ledger.reject(problem.reason, where, problem.detail, nbytes)
            continue
        doc = admit_record(text, "the pair", record, where, ledger, default_domain, nbytes)
        if doc is not None:
            doc.key = normalized(key)
            yield doc
