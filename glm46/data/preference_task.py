"""A generated preference task whose rule the verifier cannot see: the toy run of preference learning
(experiment=toy_preference) and the tests train on it.

Each prompt is one of the embedded `rl` domain's arithmetic questions (glm46.data.arithmetic.expression_problem, the
answer on a last `Answer:` line, which glm46.rl.rewards.verify checks), asking for a style:

    brief:  "... Reply with the answer line only."     ->  "Answer: 56"
    worked: "... Show the step, then the answer line." ->  "7 * 8 = 56.\\nAnswer: 56"

In a pair, the chosen reply is right and in the requested style; the rejected one is right in the other style
(`style_share` of the pairs: what only a preference can teach, since the verifier scores both 1) or wrong in the
requested style. The hidden rule (glm46.rl.style_rule): a reply ends with an `Answer: <integer>` line and shows its
step exactly when the worked style is asked for; whether the integer is right is the verifier's part. The default run's
SFT model writes the worked style whatever is asked, so it follows the rule on about half of the prompts.

`style_documents` adds the task to the embedded corpus (source=embedded_preference): the pairs as the `preference`
domain, the prompts with their chosen reply as the `style` domain (RL's prompts, the held-out skill).
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Iterator
from pathlib import Path

from .arithmetic import QUESTIONS, SYSTEM_PROMPTS, expression_problem
from .chat import render_chat
from .documents import Document, Ledger
from .preference import as_messages, pair_text

STYLES = {
    "brief": "Reply with the answer line only.",
    "worked": "Show the step, then the answer line.",
}
DOMAIN = "style"  # the domain of the prompts' chat documents (RL on them, the held-out skill)


def styled_reply(step: str, answer: int, style: str) -> str:
    return f"Answer: {answer}" if style == "brief" else f"{step}\nAnswer: {answer}"


SIDES = ("pairs", "prompts")


def side_of(messages: list[dict]) -> str:
    """The half of the prompt space a prompt belongs to, by a stable hash of its messages: the pairs draw from one,
    RL's prompts and the held-out skill from the other, so that no held-out prompt is ever a pair's (the reward
    model and DPO train on the pairs; drawn from one space, 31% of the distinct prompts were also pairs')."""
    return SIDES[zlib.crc32(json.dumps(messages).encode()) % 2]


def style_problem(rng: random.Random, side: str) -> tuple[list[dict], str, str, int]:
    """(the prompt's messages, the requested style, the worked step, the answer), from `side`'s half of the
    prompt space."""
    while True:
        expression, step, answer = expression_problem(rng)
        style = rng.choice(sorted(STYLES))
        system = rng.choice(SYSTEM_PROMPTS[:3])  # none or the neutral one: no system prompt that asks for a style
        question = rng.choice(QUESTIONS).format(expression) + f" End with a line 'Answer: <integer>'. {STYLES[style]}"
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": question})
        if side_of(messages) == side:
            return messages, style, step, answer


def preference_pairs(count: int, seed: int, style_share: float = 0.8) -> Iterator[dict]:
    """`count` pairs in TRL's conversational preference format."""
    rng = random.Random(f"{seed}:preference")
    for i in range(count):
        messages, style, step, answer = style_problem(rng, "pairs")
        chosen = styled_reply(step, answer, style)
        if rng.random() < style_share:
            rejected = styled_reply(step, answer, "worked" if style == "brief" else "brief")
        else:
            wrong = answer + rng.choice([-2, -1, 1, 2])
            rejected = styled_reply(step.replace(f"= {answer}.", f"= {wrong}."), wrong, style)
        yield {
            "prompt": messages,
            "chosen": as_messages(chosen, "assistant"),
            "rejected": as_messages(rejected, "assistant"),
            "id": f"pair-{i}",
        }


def style_prompts(count: int, seed: int) -> Iterator[dict]:
    """`count` prompts as chat documents with their chosen reply (source=chat): the RL stages' prompts and the
    held-out skill, none of them a pair's prompt (side_of)."""
    rng = random.Random(f"{seed}:prompts")
    for i in range(count):
        messages, style, step, answer = style_problem(rng, "prompts")
        reply = {"role": "assistant", "content": styled_reply(step, answer, style)}
        yield {"messages": [*messages, reply], "domain": DOMAIN, "id": f"style-{i}"}


def write_task(folder: str | Path, pairs: int, prompts: int, seed: int = 0) -> tuple[Path, Path]:
    """(pairs.jsonl, prompts.jsonl) of the task in `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = folder / "pairs.jsonl", folder / "prompts.jsonl"
    for file, records in zip(files, (preference_pairs(pairs, seed), style_prompts(prompts, seed))):
        file.write_text("".join(json.dumps(record) + "\n" for record in records))
    return files


def style_documents(ledger: Ledger, pairs: int, prompts: int, seed: int) -> Iterator[Document]:
    """The task's pairs (domain `preference`, deduplicated by prompt) and prompts (domain `style`) as documents."""
    for record in preference_pairs(pairs, seed):
        text, prompt = pair_text(record)
        source = f"generated:preference:{record['id']}"
        yield ledger.admit(Document(text=text, domain="preference", source=source, id=record["id"], key=prompt))
    for record in style_prompts(prompts, seed):
        text = render_chat(record["messages"])
        yield ledger.admit(
            Document(text=text, domain=DOMAIN, source=f"generated:style:{record['id']}", id=record["id"])
        )
