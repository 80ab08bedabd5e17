"""GLM's chat format for SFT: `[gMASK]<sop><|system|>\n...<|user|>\n...<|assistant|>\n...`, with a loss mask
on what the model must produce: assistant contents and the token that ends each assistant turn (the next
role token, or <|endoftext|> at the end; GLM-4.6 stops generating at <|user|>, <|observation|> or
<|endoftext|>)."""

from __future__ import annotations

from .tokenizer import GLMTokenizer

ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "observation": "<|observation|>"}
PREFIX = ("[gMASK]", "<sop>")


def format_chat(messages: list[dict[str, str]], tokenizer: GLMTokenizer) -> tuple[list[int], list[int]]:
    """messages [{"role", "content"}] -> (input ids, loss mask of the same length, 1 where trained)."""
    ids = [tokenizer.token_id(t) for t in PREFIX]
    mask = [0] * len(ids)
    previous = None
    for number, message in enumerate(messages):
        role = message["role"]
        if role not in ROLE_TOKENS:
            raise ValueError(f"message {number}: role {role!r} is not one of {sorted(ROLE_TOKENS)}")
        ids.append(tokenizer.token_id(ROLE_TOKENS[role]))
        mask.append(int(previous == "assistant"))  # the role token that closes an assistant turn is a target
        newline, content = tokenizer.encode("\n"), tokenizer.encode(message["content"])
        ids += newline + content
        mask += [0] * len(newline) + [int(role == "assistant")] * len(content)
        previous = role
    if previous == "assistant":
        ids.append(tokenizer.token_id("<|endoftext|>"))
        mask.append(1)
    return ids, mask
