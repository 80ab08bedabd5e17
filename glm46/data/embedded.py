"""The embedded corpus: documents every machine has, plus generated domains with checkable answers.

- code: each standard-library module; repo_code: each standard-library package's modules
  concatenated with file headers (GLM's repository-level documents);
- docs: the interpreter's documentation topics (pydoc_data); license: the license and copyright
  texts under /usr/share on Debian (many near-identical: real work for the deduplicator);
- math: arithmetic with worked steps; reasoning: multi-step word problems with a <think> trace.
Everything is deterministic given the seed.
"""

from __future__ import annotations

import os
import random
import sysconfig
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from .documents import Document, Ledger

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}
LICENSE_GLOBS = ("/usr/share/common-licenses/*", "/usr/share/doc/*/copyright")


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
        if len(relative.parts) > 1:
            packages[relative.parts[0]].append(doc)
        yield doc
    for package, modules in sorted(packages.items()):
        text = "\n\n".join(f"# file: {m.id}\n{m.text}" for m in modules)
        yield ledger.admit(Document(text=text, domain="repo_code", source=str(root / package), id=package))


def python_docs(ledger: Ledger) -> Iterator[Document]:
    from pydoc_data.topics import topics

    for name, text in sorted(topics.items()):
        yield ledger.admit(Document(text=text, domain="docs", source=f"pydoc_data.topics:{name}", id=name))


def license_texts(ledger: Ledger) -> Iterator[Document]:
    for pattern in LICENSE_GLOBS:
        for path in sorted(Path("/").glob(pattern.lstrip("/"))):
            if path.is_file():
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
    steps = (f"Split {b} into {tens} + {ones}. {a} * {tens} = {a * tens}. {a} * {ones} = {a * ones}. "
             f"{a * tens} + {a * ones} = {a * b}.")
    return f"What is {a} * {b}?", steps, a * b


def word_problem(rng: random.Random) -> tuple[str, str, int]:
    """A three-step word problem: (question, reasoning trace, answer)."""
    name = rng.choice(["Ada", "Alan", "Grace", "Linus", "Barbara", "Edsger"])
    start, bags, per_bag, given = rng.randint(2, 30), rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 20)
    bought = bags * per_bag
    answer = start + bought - given
    question = (f"{name} has {start} marbles, buys {bags} bags of {per_bag} marbles each, then gives away {given}. "
                f"How many marbles does {name} have now?")
    trace = (f"{name} buys {bags} x {per_bag} = {bought} marbles. Before giving any away: {start} + {bought} = "
             f"{start + bought}. After giving away {given}: {start + bought} - {given} = {answer}.")
    return question, trace, answer


def generated(ledger: Ledger, math_problems: int, reasoning_problems: int, seed: int) -> Iterator[Document]:
    rng = random.Random(seed)
    for i in range(math_problems):
        question, steps, answer = arithmetic_problem(rng)
        yield ledger.admit(Document(text=f"Question: {question}\nSolution: {steps}\nAnswer: {answer}",
                                    domain="math", source=f"generated:math:{i}", id=f"math-{i}"))
    for i in range(reasoning_problems):
        question, trace, answer = word_problem(rng)
        yield ledger.admit(Document(text=f"Question: {question}\n<think>{trace}</think>\nAnswer: {answer}",
                                    domain="reasoning", source=f"generated:reasoning:{i}", id=f"reasoning-{i}"))


def read_embedded(paths: list[str], ledger: Ledger, default_domain: str = "general", math_problems: int = 20000,
                  reasoning_problems: int = 10000, seed: int = 0) -> Iterator[Document]:
    """All embedded domains; `paths` and `default_domain` are unused (the sources are fixed)."""
    yield from stdlib_code(ledger)
    yield from python_docs(ledger)
    yield from license_texts(ledger)
    yield from generated(ledger, math_problems, reasoning_problems, seed)
