"""The embedded corpus: documents every machine has, plus generated domains with checkable answers.

- code: each standard-library module; repo_code: each standard-library package's modules
  concatenated with file headers (GLM's repository-level documents);
- docs: the interpreter's documentation topics (pydoc_data); license: the Python's LICENSE.txt and Debian's common
  licenses (a fixed list of base-files' texts, near-identical versions and aliases among them: real work for the
  deduplicator). Only files that come with the Python or with every Debian and Ubuntu system are read, never what
  other packages install, so that installing packages leaves the corpus as it is;
- math: arithmetic with worked steps; reasoning: multi-step word problems with a <think> trace;
- sft: chat-formatted conversations (GLM's template, glm46.data.chat) asking those questions, with
  system-prompt variants, thinking and non-thinking (`/nothink`) replies and some two-turn follow-ups;
- rl: chat prompts of one-digit arithmetic (varied wordings) with a reference reply whose final `Answer:`
  line is the integer that glm46.rl.rewards.verify checks; half of the sft conversations ask the same way;
- tool: `What is A * B?` (A of 4 digits, B of 2) in chats that offer the `calculator` tool (glm46.data.tools),
  answered with a calculator call, its result and `Answer: N`: agentic RL's prompts and the held-out tool skill;
  `sft_tool_share` of the sft conversations are such chats (a tenth by default);
- copy (only when asked for, `copy_drills`): lists of random numbers, then the same list again. A small model
  learns to copy from its context (an induction head) after a few hundred steps of these, far sooner than from
  natural text; the tool skill needs it (experiment=toy_recipe_tools, docs/default-run.md).
Everything is deterministic given the seed; each generated domain draws from its own random stream.
"""

from __future__ import annotations

import os
import random
import sysconfig
from collections import defaultdict
from collections.abc import Iterator
from functools import partial
from pathlib import Path

from .arithmetic import QUESTIONS, SYSTEM_PROMPTS, expression_problem
from .chat import render_chat
from .documents import Document, Ledger, normalized
from .preference_task import style_documents
from .tools import Calculator

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}
# base-files' /usr/share/common-licenses (an Essential package on Debian and Ubuntu; GFDL, GPL and LGPL are aliases of
# the latest versions): a fixed list, since the folder is the place for every license text a package may read
COMMON_LICENSES = Path("/usr/share/common-licenses")
COMMON_LICENSE_NAMES = (
    "Apache-2.0", "Artistic", "BSD", "CC0-1.0", "GFDL", "GFDL-1.2", "GFDL-1.3", "GPL", "GPL-1", "GPL-2", "GPL-3",
    "LGPL", "LGPL-2", "LGPL-2.1", "LGPL-3", "MPL-1.1", "MPL-2.0",
)  # fmt: skip


def _read(path: Path, ledger: Ledger, domain: str) -> Document | None:
    raw = path.read_bytes()
    try:
        return ledger.admit(Document(text=raw.decode("utf-8"), domain=domain, source=str(path), id=str(path)))
    except UnicodeDecodeError as error:
        ledger.reject("undecodable", str(path), str(error), len(raw))
        return None


def _stdlib_modules(root: Path) -> list[Path]:
    """The standard library's .py files, not descending into tests or site-packages."""
    paths = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in SKIP_DIRS)
        paths += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(paths)


def stdlib_code(ledger: Ledger) -> Iterator[Document]:
    """Modules as `code` documents, then packages as `repo_code` documents."""
    root = Path(sysconfig.get_paths()["stdlib"])
    packages = defaultdict(list)
    for path in _stdlib_modules(root):
        relative = path.relative_to(root)
        doc = _read(path, ledger, "code")
        if doc is None:
            continue
        doc.id = str(relative)
        if len(relative.parts) > 1:  # as normalised, whether or not the reader's consumer has normalised doc yet
            packages[relative.parts[0]].append((doc.id, normalized(doc.text)))
        yield doc
    for package, modules in sorted(packages.items()):
        text = "\n\n".join(f"# file: {name}\n{module}" for name, module in modules)
        yield ledger.admit(Document(text=text, domain="repo_code", source=str(root / package), id=package))


def source_files() -> list[Path]:
    """Every file the embedded readers read (the generated domains depend only on their options)."""
    import pydoc_data.topics

    root = Path(sysconfig.get_paths()["stdlib"])
    return _stdlib_modules(root) + [Path(pydoc_data.topics.__file__)] + license_files()


def python_docs(ledger: Ledger) -> Iterator[Document]:
    from pydoc_data.topics import topics

    for name, text in sorted(topics.items()):
        yield ledger.admit(Document(text=text, domain="docs", source=f"pydoc_data.topics:{name}", id=name))


def license_files(common: Path = COMMON_LICENSES) -> list[Path]:
    """The Python's license, then those of the common licenses that this system has."""
    python = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    return [p for p in [python, *(common / name for name in COMMON_LICENSE_NAMES)] if p.is_file()]


def license_texts(ledger: Ledger) -> Iterator[Document]:
    for path in license_files():
        doc = _read(path, ledger, "license")
        if doc is not None:
            yield doc


def arithmetic_problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, worked steps, answer)."""
    a, b = rng.randint(10, 999), rng.randint(2, 99)
    op = rng.choice("+-*")
    if op == "+":
        steps = f"{a} + {b}: add the ones, then the tens and hundreds, carrying as needed: {a} + {b} = {a + b}."
        return f"What is {a} + {b}?", steps, a + b
    if op == "-":
        steps = f"{a} - {b}: subtract the ones, then the tens, borrowing as needed: {a} - {b} = {a - b}."
        return f"What is {a} - {b}?", steps, a - b
    tens, ones = b // 10 * 10, b % 10
    steps = (
        f"Split {b} into {tens} + {ones}. {a} * {tens} = {a * tens}. {a} * {ones} = {a * ones}. "
        f"{a * tens} + {a * ones} = {a * b}."
    )
    return f"What is {a} * {b}?", steps, a * b


def word_problem(rng: random.Random) -> tuple[str, str, int]:
    """A three-step word problem: (question, reasoning trace, answer)."""
    name = rng.choice(["Ada", "Alan", "Grace", "Linus", "Barbara", "Edsger"])
    start, bags, per_bag, given = rng.randint(2, 30), rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 20)
    bought = bags * per_bag
    answer = start + bought - given
    question = (
        f"{name} has {start} marbles, buys {bags} bags of {per_bag} marbles each, then gives away {given}. "
        f"How many marbles does {name} have now?"
    )
    trace = (
        f"{name} buys {bags} x {per_bag} = {bought} marbles. Before giving any away: {start} + {bought} = "
        f"{start + bought}. After giving away {given}: {start + bought} - {given} = {answer}."
    )
    return question, trace, answer


FOLLOW_UPS = [
    ("Now add {k} to that.", lambda x, k: (f"{x} + {k} = {x + k}.", x + k)),
    ("And if you subtract {k} from it?", lambda x, k: (f"{x} - {k} = {x - k}.", x - k)),
    ("What is {k} times that?", lambda x, k: (f"{k} * {x} = {k * x}.", k * x)),
]


CALCULATOR = Calculator()
SFT_TOOL_SHARE = 0.1  # of the sft conversations by default: each is about 4 times as long as the others (tools)


def tool_problem(rng: random.Random) -> tuple[str, int]:
    """A 4-digit by 2-digit product: beyond what the toy model works out in its head, one calculator call away."""
    a, b = rng.randint(1000, 9999), rng.randint(10, 99)
    return f"{a} * {b}", a * b


def tool_conversation(rng: random.Random) -> list[dict]:
    """`What is A * B?` answered with a `calculator` call (GLM's tool-call format), its result, and `Answer: N`."""
    expression, answer = tool_problem(rng)
    system = rng.choice(SYSTEM_PROMPTS)
    call = {"type": "function", "function": {"name": CALCULATOR.name, "arguments": {"expression": expression}}}
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": f"What is {expression}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": str(answer)},
        {"role": "assistant", "content": f"Answer: {answer}"},
    ]


def offered_tools(messages: list[dict]) -> list[dict] | None:
    """The tools a generated chat lists: the calculator in one that calls it, else none."""
    return [CALCULATOR.schema] if any(message.get("tool_calls") for message in messages) else None


def render(messages: list[dict]) -> str:
    """A generated chat in GLM's format."""
    return render_chat(messages, tools=offered_tools(messages))


def conversation(rng: random.Random, tool_share: float = SFT_TOOL_SHARE) -> list[dict]:
    """An SFT conversation: a tool conversation (`tool_share` of them), else an expression in the RL prompts' format
    (half: SFT
    teaches the format and facts that RL then sharpens, as GLM's SFT precedes its reasoning RL), or an arithmetic or
    word problem, answered with its steps (inside <think> for word problems, GLM's thinking mode, empty after
    `/nothink`) and a final `Answer:` line; a third of the latter continue with a follow-up question on the previous
    answer."""
    if rng.random() < tool_share:
        return tool_conversation(rng)
    if rng.random() < 1 / 2:
        return rl_prompt(rng)
    system = rng.choice(SYSTEM_PROMPTS)
    messages = [{"role": "system", "content": system}] if system else []
    if rng.random() < 0.5:
        question, steps, answer = arithmetic_problem(rng)
        reply = f"{steps}\nAnswer: {answer}"
    else:
        question, trace, answer = word_problem(rng)
        if rng.random() < 0.25:
            question, trace = question + " /nothink", ""
        reply = f"<think>{trace}</think>\nAnswer: {answer}"
    messages += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
    if rng.random() < 1 / 3:
        template, solve = rng.choice(FOLLOW_UPS)
        k = rng.randint(2, 9) if "times" in template else rng.randint(2, 99)
        steps, answer = solve(answer, k)
        messages += [
            {"role": "user", "content": template.format(k=k)},
            {"role": "assistant", "content": f"{steps}\nAnswer: {answer}"},
        ]
    return messages


def copy_drill(rng: random.Random) -> str:
    """3-8 random numbers of 2-5 digits, then the same numbers again."""
    numbers = " ".join(
        str(rng.randint(10 ** (n - 1), 10**n - 1)) for n in rng.choices(range(2, 6), k=rng.randint(3, 8))
    )
    return f"Numbers: {numbers}\nAgain: {numbers}"


def rl_prompt(rng: random.Random) -> list[dict[str, str]]:
    """An RL prompt with its reference reply (the verifiable answer is the reply's `Answer:` integer)."""
    expression, steps, answer = expression_problem(rng)
    system = rng.choice(SYSTEM_PROMPTS)
    messages = [{"role": "system", "content": system}] if system else []
    question = rng.choice(QUESTIONS).format(expression)
    return messages + [
        {"role": "user", "content": f"{question} End with a line 'Answer: <integer>'."},
        {"role": "assistant", "content": f"{steps}\nAnswer: {answer}"},
    ]


def generated(
    ledger: Ledger,
    math_problems: int,
    reasoning_problems: int,
    seed: int,
    sft_conversations: int = 0,
    rl_prompts: int = 0,
    tool_prompts: int = 0,
    copy_drills: int = 0,
    sft_tool_share: float = SFT_TOOL_SHARE,
) -> Iterator[Document]:
    if not 0 <= sft_tool_share <= 1:  # also refused at composition (task=prepare); a training run prepares here
        raise ValueError(
            f"source.options.sft_tool_share={sft_tool_share}: a share of the sft conversations, from 0 to 1"
        )
    rng = random.Random(seed)
    for i in range(math_problems):
        question, steps, answer = arithmetic_problem(rng)
        yield ledger.admit(
            Document(
                text=f"Question: {question}\nSolution: {steps}\nAnswer: {answer}",
                domain="math",
                source=f"generated:math:{i}",
                id=f"math-{i}",
            )
        )
    for i in range(reasoning_problems):
        question, trace, answer = word_problem(rng)
        yield ledger.admit(
            Document(
                text=f"Question: {question}\n<think>{trace}</think>\nAnswer: {answer}",
                domain="reasoning",
                source=f"generated:reasoning:{i}",
                id=f"reasoning-{i}",
            )
        )
    rng = random.Random(f"{seed}:copy")
    for i in range(copy_drills):
        yield ledger.admit(Document(text=copy_drill(rng), domain="copy", source=f"generated:copy:{i}", id=f"copy-{i}"))
    chats = (
        ("sft", sft_conversations, partial(conversation, tool_share=sft_tool_share)),
        ("rl", rl_prompts, rl_prompt),
        ("tool", tool_prompts, tool_conversation),
    )
    for domain, count, make in chats:
        rng = random.Random(f"{seed}:{domain}")
        for i in range(count):
            text = render(make(rng))
            yield ledger.admit(Document(text=text, domain=domain, source=f"generated:{domain}:{i}", id=f"{domain}-{i}"))


def read_embedded(
    paths: list[str],
    ledger: Ledger,
    default_domain: str = "general",
    math_problems: int = 20000,
    reasoning_problems: int = 10000,
    seed: int = 0,
    sft_conversations: int = 10000,
    rl_prompts: int = 40000,
    tool_prompts: int = 8000,
    copy_drills: int = 0,
    sft_tool_share: float = SFT_TOOL_SHARE,
    preference_pairs: int = 0,
    style_prompts: int = 0,
) -> Iterator[Document]:
    """All embedded domains; `paths` and `default_domain` are unused (the sources are fixed). preference_pairs and
    style_prompts: the generated preference task's (glm46.data.preference_task), none by default."""
    yield from stdlib_code(ledger)
    yield from python_docs(ledger)
    yield from license_texts(ledger)
    yield from generated(
        ledger,
        math_problems,
        reasoning_problems,
        seed,
        sft_conversations,
        rl_prompts,
        tool_prompts,
        copy_drills,
        sft_tool_share,
    )
    yield from style_documents(ledger, preference_pairs, style_prompts, seed)
