"""The hidden rule of the generated preference task (glm46.data.preference_task): what its pairs prefer and its
verifier cannot see. The toy run measures it (lm-eval's `glm46_style`) and watches it in RL (phase.reward.monitor).
"""

from __future__ import annotations

import re

from glm46.data.chat import STOP_TOKENS
from glm46.data.preference_task import STYLES
from glm46.rl.rewards import extract_answer

STOP = re.compile("|".join(re.escape(token) for token in STOP_TOKENS))


def requested_style(prompt: str) -> str | None:
    """The style a prompt's text asks for, or None."""
    return next((style for style, request in STYLES.items() if request in prompt), None)


def follows_style(style: str | None, reply: str) -> bool:
    """The hidden rule: the reply (up to GLM's first stop token) ends with an `Answer: <integer>` line and shows its
    step (an `=`) exactly when the worked style is asked for."""
    text = STOP.split(reply, maxsplit=1)[0].strip().removeprefix("<think></think>").strip()
    return style is not None and extract_answer(text) is not None and (("=" in text) == (style == "worked"))


def follows_requested_style(prompt: str, reply: str) -> float:
    """follows_style with the style the prompt asks for: 1.0 or 0.0 (a monitor of RL: phase.reward.monitor)."""
    return float(follows_style(requested_style(prompt), reply))
