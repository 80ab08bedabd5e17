"""GLM's chat format for SFT: `[gMASK]<sop><|system|>\n...<|user|>\n...<|assistant|>\n...`, with a loss mask
on what the model must produce: everything after each `<|assistant|>` (the newline, the content) and the
token that ends the turn (the next role token, or <|endoftext|> at the end; GLM-4.6 stops generating at
<|user|>, <|observation|> or <|endoftext|>). A prompt ends at `<|assistant|>` (glm46.rl.prompts, the eval
tasks), so the newline is the first token the model generates: it is trained too.

Chat documents are stored as their rendered text (`render_chat`), so deduplication, quality rules,
tokenizer training and token shards see exactly what the model sees; the shards then hold
`format_chat`'s ids (each document followed by <|endoftext|>), and `assistant_mask` recovers its
loss mask from the ids alone (both tested equal to `format_chat`).
"""

from __future__ import annotations

import numpy as np

from .tokenizer import GLMTokenizer

ROLE_TOKENS = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "observation": "<|observation|>",
}
PREFIX = ("[gMASK]", "<sop>")
EOS = "<|endoftext|>"
STOP_TOKENS = (EOS, ROLE_TOKENS["user"], ROLE_TOKENS["observation"])  # where GLM ends a reply
# `render_chat` as a Jinja chat template, for tokenizer_config.json (transformers' apply_chat_template, vLLM's
# and SGLang's chat endpoints); tested to give format_chat's ids for every role. GLM-4.6's own template adds
# tools and thinking.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages -%}"
    "{%- if message.role not in ['system', 'user', 'assistant', 'observation'] -%}"
    "{{- raise_exception('message ' ~ loop.index0 ~ ': role ' ~ message.role"
    " ~ ' is not one of [assistant, observation, system, user]') -}}"
    "{%- endif -%}"
    "{{- '<|' ~ message.role ~ '|>\n' ~ message.content -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def _check_role(number: int, role: str) -> str:
    if role not in ROLE_TOKENS:
        raise ValueError(f"message {number}: role {role!r} is not one of {sorted(ROLE_TOKENS)}")
    return ROLE_TOKENS[role]


def format_chat(messages: list[dict[str, str]], tokenizer: GLMTokenizer) -> tuple[list[int], list[int]]:
    """messages [{"role", "content"}] -> (input ids, loss mask of the same length, 1 where trained)."""
    ids = [tokenizer.token_id(t) for t in PREFIX]
    mask = [0] * len(ids)
    previous = None
    for number, message in enumerate(messages):
        role = message["role"]
        ids.append(tokenizer.token_id(_check_role(number, role)))
        mask.append(int(previous == "assistant"))  # the role token that closes an assistant turn is a target
        newline, content = tokenizer.encode("\n"), tokenizer.encode(message["content"])
        ids += newline + content
        mask += [int(role == "assistant")] * (len(newline) + len(content))
        previous = role
    if previous == "assistant":
        ids.append(tokenizer.token_id(EOS))
        mask.append(1)
    return ids, mask


def render_chat(messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
    """The template as text: `format_chat`'s ids without the final <|endoftext|> (the shard writer appends
    one to every document). `generation_prompt` appends `<|assistant|>`, where a model starts its reply."""
    text = "".join(PREFIX) + "".join(f"{_check_role(n, m['role'])}\n{m['content']}" for n, m in enumerate(messages))
    return text + ROLE_TOKENS["assistant"] if generation_prompt else text


class ChatTokens:
    """The special-token ids the chat format uses, from a tokenizer, and a per-id table of their kinds."""

    BOUNDARY, ASSISTANT = 1, 2

    def __init__(self, tokenizer: GLMTokenizer):
        self.assistant = tokenizer.token_id(ROLE_TOKENS["assistant"])
        self.eos = tokenizer.token_id(EOS)
        self.gmask = tokenizer.token_id(PREFIX[0])
        boundaries = [tokenizer.token_id(t) for t in ROLE_TOKENS.values()] + [self.eos, self.gmask]
        self.kind = np.zeros(max(tokenizer.vocab_size, *boundaries) + 1, dtype=np.int8)  # 0: any other token
        self.kind[boundaries] = self.BOUNDARY
        self.kind[self.assistant] = self.ASSISTANT


def assistant_mask(ids: np.ndarray, chat: ChatTokens) -> np.ndarray:
    """`format_chat`'s loss mask, from ids alone (uint8, the length of `ids`): 1 on the tokens of an assistant
    turn after its role token (the newline included), and on the role token or <|endoftext|> that closes it.
    `ids` may hold several conversations end to end; it should start at a conversation's start."""
    kind = chat.kind[np.asarray(ids)]
    boundary = kind > 0  # a role token, <|endoftext|> or [gMASK]: a turn starts or ends here
    index = np.arange(len(kind))
    previous = np.empty_like(index)  # the newest boundary strictly before i (-1: none)
    previous[:1] = -1
    np.maximum.accumulate(np.where(boundary, index, -1)[:-1], out=previous[1:])
    in_reply = np.where(previous >= 0, kind[previous], 0) == ChatTokens.ASSISTANT
    return in_reply.astype(np.uint8)  # boundaries in a reply close it: trained too
