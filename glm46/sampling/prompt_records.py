"""The prompts rejection sampling answers: each conversation up to the reply it asks for, with the reference's answer
where it has one (a verifiable prompt) and the tools it offers.

Two inputs:
- a prepared dataset (task=prepare of chat or RL prompts, what data=rl reads): every document of `domains`, of the
  held-out tail (`split=val`, the last val_fraction as the DataModules hold out), of the rest (`train`) or of all;
  the prompt ends at the `<|assistant|>` that opens the reply to the last user turn, as glm46.rl.prompts cuts it;
- a JSONL file of `{"messages": [...], "tools": [...], "answer": 42, "domain": "...", "id": "..."}`: the messages
  end with the user turn, or with a reference reply that is dropped (its `Answer:` line gives `answer` when the
  record has none). A record that cannot be read raises ValueError naming its file and line.

A prompt without an answer is open: only a reward model judges its samples.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glm46.data.chat import ROLE_TOKENS, ChatTokens, conversation_problem, render_chat, reply_span, visible_text
from glm46.data.chat_parse import parse_chat
from glm46.data.shards import load_shard, read_index
from glm46.data.tokenizer import GLMTokenizer
from glm46.data.windows import DomainStream
from glm46.rl.rewards import extract_answer

SPLITS = ("train", "val", "all")


@dataclass
class SamplePrompt:
    index: int  # its place among every prompt read: seeds its candidates, orders the output
    id: str
    domain: str
    ids: list[int]  # the rendered conversation up to and including the <|assistant|> that opens the reply
    messages: list[dict]  # the conversation before the reply
    tools: list[dict] | None
    answer: int | None  # the reference's final integer; None: an open prompt
    reference: list[dict]  # the reference reply's messages (none: a prompt without one)


def read_prompts(
    path: str | Path, tokenizer: GLMTokenizer, split: str = "all", val_fraction: float = 0.02,
    domains: list[str] | None = None,
) -> list[SamplePrompt]:  # fmt: skip
    """Every prompt of a prepared dataset (a directory) or a JSONL file, in order."""
    path = Path(path)
    if path.is_dir():
        return prepared_prompts(path, tokenizer, split, val_fraction, domains)
    return jsonl_prompts(path, tokenizer)


def prepared_prompts(
    data: Path, tokenizer: GLMTokenizer, split: str, val_fraction: float, domains: list[str] | None
) -> list[SamplePrompt]:
    chat = ChatTokens(tokenizer)
    index = read_index(data / "tokens")
    prompts: list[SamplePrompt] = []
    for domain in domains or sorted(index["domains"]):
        tokens, offsets = load_shard(data / "tokens", domain)
        stream = DomainStream(tokens, offsets, val_fraction)
        held_out = len(stream.val_offsets) - 1
        for number, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
            in_val = number >= len(offsets) - 1 - held_out
            if split != "all" and in_val != (split == "val"):
                continue
            document = np.asarray(tokens[start:end], dtype=np.int64)
            if not (document == chat.assistant).any() or not (document == chat.user).any():
                continue  # no reply to a user turn: not a prompt
            reply, last = reply_span(document, chat)
            answer = extract_answer(tokenizer.decode(document[last:-1].tolist()))
            try:
                messages, tools = parse_chat(tokenizer.decode(document.tolist()))
            except ValueError as error:
                raise ValueError(f"{data}: document {number} of domain {domain!r} is no chat prompt: {error}") from None
            last_user = max(n for n, message in enumerate(messages) if message["role"] == "user")
            prompt, reference = messages[: last_user + 1], messages[last_user + 1 :]
            name, ids = f"{domain}/{number}", document[:reply].tolist()
            prompts.append(SamplePrompt(len(prompts), name, domain, ids, prompt, tools, answer, reference))
    return prompts


def jsonl_prompts(file: Path, tokenizer: GLMTokenizer) -> list[SamplePrompt]:
    prompts = []
    for line_number, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file}:{line_number}"
        try:
            record = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{where}: not JSON ({error})") from None
        if not isinstance(record, dict) or "messages" not in record:
            raise ValueError(f"{where}: not an object with a field 'messages'")
        messages, tools, answer, reference = list(record["messages"]), record.get("tools"), record.get("answer"), []
        problem = conversation_problem(messages, tools)
        if problem:
            raise ValueError(f"{where}: {problem[1]}")
        if messages[-1]["role"] == "assistant":  # the reference reply
            reference = [messages.pop()]
            answer = answer if answer is not None else extract_answer(visible_text(reference[0].get("content")))
        if not messages or messages[-1]["role"] != "user":
            raise ValueError(f"{where}: the conversation does not end with a user turn (or one and its reply)")
        if answer is not None and not isinstance(answer, int):
            raise ValueError(f"{where}: field 'answer' is {answer!r}, not an integer")
        text = render_chat(messages, tools) + ROLE_TOKENS["assistant"]
        prompts.append(
            SamplePrompt(len(prompts), str(record.get("id", f"{file.name}:{line_number}")),
                         str(record.get("domain", "sft")), tokenizer.encode(text), messages, tools, answer, reference)
        )  # fmt: skip
    return prompts
