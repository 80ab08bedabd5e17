"""The wordings of the generated arithmetic prompts: one-digit expressions asked in 16 ways, under 6 system prompts.
The embedded corpus's `rl` and `sft` domains (glm46.data.embedded) and the generated preference task
(glm46.data.preference_task) ask them."""

from __future__ import annotations

import random

SYSTEM_PROMPTS = [
    None,
    None,
    "You are a helpful assistant.",
    "You are a careful math tutor. Show your working.",
    "Answer briefly and end with the final answer.",
    "Solve the problem, then state the answer.",
]


def expression_problem(rng: random.Random) -> tuple[str, str, int]:
    """One operation on one-digit numbers, e.g. 7 * 8: (expression, worked step, integer answer). A table of 192
    facts, small enough for the toy model to learn within the default run, so that SFT and then RL visibly raise
    its accuracy (a wider range, such as two operations on numbers up to 99, stays near 0% there)."""
    a, b, op = rng.randint(2, 9), rng.randint(2, 9), rng.choice("+-*")
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a} {op} {b}", f"{a} {op} {b} = {answer}.", answer


QUESTIONS = [  # 16 wordings x 6 system prompts x 192 facts: enough distinct documents to hold out hundreds
    "Compute {}.",
    "What is {}?",
    "Calculate {}.",
    "Evaluate {}.",
    "Work out {}.",
    "{} = ?",
    "Find the value of {}.",
    "Solve: {}.",
    "How much is {}?",
    "Give the result of {}.",
    "Quick question: {}?",
    "Please compute {}.",
    "What do you get for {}?",
    "Determine {}.",
    "Tell me {}.",
    "Simplify {}.",
]
