"""Rewards for RL on prompts with a verifiable integer answer (the embedded `rl` domain).

The answer format, which the generated SFT and RL references use and `verify` checks: a reply's final
answer is the integer on its last `Answer:` line (`Answer: 42`, a trailing period allowed) or in its
last `\\boxed{42}`, whichever comes later. The reply ends at the first of GLM's stop tokens
(<|endoftext|>, <|user|>, <|observation|>), which a decoded completion may hold. Anything else in the
answer's place (no such line, `Answer: forty-two`, `Answer: 4.5`, `Answer: 42 apples`) is malformed.
The reward is 1.0 for the right integer, 0.0 otherwise: GLM-4.5's reasoning RL uses such binary
outcome rewards on verified answers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_FINAL = re.compile(r"\\boxed\{([^{}\n]*)\}|Answer:([^\n]*)")
_STOP = re.compile(r"<\|endoftext\|>|<\|user\|>|<\|observation\|>")
_INTEGER = re.compile(r"[+-]?\d+")
_BOXED = re.compile(r"^\\boxed\{(.*)\}$")


def extract_answer(text: str) -> int | None:
    """The integer of the reply's last `Answer:` line or `\\boxed{}`, or None when it is missing or malformed."""
    finals = _FINAL.findall(_STOP.split(text, maxsplit=1)[0])
    if not finals:
        return None
    boxed, line = finals[-1]
    value = (boxed or line).strip().removesuffix(".").strip()
    value = _BOXED.sub(r"\1", value).strip()  # `Answer: \boxed{42}`
    return int(value) if _INTEGER.fullmatch(value) else None


def verify(record: Mapping, completion: str) -> float:
    """Reward of a completion for a prompt record {"answer": int, ...}: 1.0 if its final answer is right, else 0.0."""
    answer = extract_answer(completion)
    return float(answer is not None and answer == int(record["answer"]))
