"""Preference pairs in TRL's preference format, one JSONL line each, as documents of the preparation.

    {"prompt": "...", "chosen": "...", "rejected": "..."}                                  (standard)
    {"prompt": [{"role": "user", "content": ...}, ...],
     "chosen": [{"role": "assistant", "content": ...}], "rejected": [...], "tools": [...]}   (conversational)

A string prompt is one user turn, a string side one assistant turn. Each side is rendered after the prompt in
GLM-4.6's chat format (glm46.data.chat), and a pair is ONE document: the chosen conversation, then the rejected
reply alone (the prompt is stored once):

    [gMASK]<sop>{prompt}<|assistant|>{chosen reply}<|endoftext|><|assistant|>{rejected reply}

(the shard writer appends the last <|endoftext|>), so that a pair is counted, kept or dropped whole and the
tokenizer trains on what the models read; glm46.lit.preference_data rebuilds the rejected conversation as the
prompt's tokens and the tokens after the first <|endoftext|>. Exact deduplication compares the prompt
(`Document.key`): a prompt keeps its first pair. The quality rules judge the document as any other.

A line that cannot be a pair is counted at its file:line under its reason: `malformed` (bad JSON, not an object,
a message that is no message), `preference/no_prompt`, `preference/missing_side` (no `chosen` or no `rejected`, or
an empty one), `preference/identical` (both sides render the same), `preference/reply_not_assistant` (a side that
does not open with an assistant turn), and the conversation's own (`chat/unknown_role`, ...:
glm46.data.chat.conversation_problem).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .chat import EOS, conversation_problem, render_chat
from .documents import Document, Ledger, normalized
from .sources import admit_record, domain_problem, json_kind, jsonl_records

SIDES = ("chosen", "rejected")


def as_messages(value: Any, role: str) -> Any:
    """A string as one message of `role`; a list as it is (checked by conversation_problem)."""
    return [{"role": role, "content": value}] if isinstance(value, str) else value


def _empty(value: Any) -> bool:
    return value is None or (
        isinstance(value, (str, list)) and not (value.strip() if isinstance(value, str) else value)
    )


def pair_problem(record: Any) -> tuple[str, str] | None:
    """Why a record is no preference pair: (reason, detail), or None."""
    if not isinstance(record, dict):
        return "malformed", f"{json_kind(record)}, not an object with fields 'prompt', 'chosen' and 'rejected'"
    if _empty(record.get("prompt")):
        return "preference/no_prompt", f"no prompt (fields: {', '.join(map(str, list(record)[:10])) or 'none'})"
    missing = [side for side in SIDES if _empty(record.get(side))]
    if missing:
        return "preference/missing_side", f"no {' and no '.join(repr(side) for side in missing)}"
    for field in ("prompt", *SIDES):
        if not isinstance(record[field], (str, list)):
            return "malformed", f"field {field!r} is {json_kind(record[field])}, not a string or a list of messages"
    prompt = as_messages(record["prompt"], "user")
    for side in SIDES:
        reply = as_messages(record[side], "assistant")
        problem = conversation_problem(prompt + reply, record.get("tools"))
        if problem:
            reason, detail = problem
            return (reason if reason == "malformed" else f"chat/{reason}"), f"{side}: {detail}"
        if reply[0].get("role") != "assistant":
            return "preference/reply_not_assistant", f"{side} opens with a {reply[0].get('role')!r} turn"
    if (domain := domain_problem(record)) is not None:
        return "malformed", domain
    return None


def pair_text(record: dict) -> tuple[str, str]:
    """(the pair's document text, its prompt as rendered: the deduplication key) of a record pair_problem passed."""
    prompt, tools = as_messages(record["prompt"], "user"), record.get("tools")
    head = render_chat(prompt, tools)
    chosen, rejected = (render_chat(prompt + as_messages(record[side], "assistant"), tools) for side in SIDES)
    assert chosen.startswith(head) and rejected.startswith(head), "a reply changed how its prompt renders"
    return f"{chosen}{EOS}{rejected.removeprefix(head)}", head


def read_preference(paths: list[str], ledger: Ledger, default_domain: str = "preference") -> Iterator[Document]:
    for record, where, nbytes in jsonl_records(paths, ledger):
        problem = pair_problem(record)
        if problem is None:
            text, prompt = pair_text(record)
            chosen, _, rejected = text.partition(EOS)
            if normalized(chosen.removeprefix(prompt)) == normalized(rejected):
                problem = "preference/identical", "chosen and rejected render the same"
        if problem:
            ledger.reject(problem[0], where, problem[1], nbytes)
            continue
        doc = admit_record(text, "the pair", record, where, ledger, default_domain, nbytes)
        if doc is not None:
            doc.key = normalized(prompt)
            yield doc
