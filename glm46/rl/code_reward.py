"""Code as an RL reward: the share of a prompt's tests that a completion's program passes, each test run with the
program in the sandbox (glm46.sandbox), as HumanEval's and MBPP's checks run it (program, then test, in one
process: the test passes when the process exits 0).

    reward = passed tests / tests            (0 for a program that does not run: a syntax error, a crash on import)
    None  where the sandbox could not start: an infrastructure failure, never scored 0 (open-instruct found 5-15%
          of its "zero" code rewards to be such failures, and masks them)

The program is the completion's last ```python block (or its last ``` block, else the whole completion). Like the
benchmarks' own checks, a program that ends the interpreter before a test's assertion (os._exit(0)) is not told apart
from one that passes; the sandbox bounds what it can do, not what it can claim.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from glm46.sandbox import PASSED, Outcome, Sandbox

_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)
_PYTHON_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.S)


def extract_program(completion: str) -> str:
    """The completion's last ```python block, else its last ``` block, else all of it."""
    for pattern in (_PYTHON_BLOCK, _BLOCK):
        blocks = pattern.findall(completion)
        if blocks:
            return blocks[-1]
    return completion


@dataclass(frozen=True)
class CodeScore:
    """A completion's tests: how many passed, whether the program ran at all, and the sandbox's failures."""

    passed: int
    tests: int
    runs: bool
    sandbox_errors: int

    @property
    def reward(self) -> float | None:
        if self.sandbox_errors:
            return None
        return self.passed / self.tests if self.runs and self.tests else 0.0


def score_code(completion: str, tests: Sequence[str], sandbox: Sandbox, setup: str = "") -> CodeScore:
    """Run `setup` (a benchmark's prompt code, imports) + the completion's program alone, then with each test."""
    program = setup + extract_program(completion)
    alone = sandbox.run({"solution.py": program}, ["solution.py"])
    if alone.infrastructure_failure:
        return CodeScore(0, len(tests), False, 1)
    if alone.status != PASSED:
        return CodeScore(0, len(tests), False, 0)
    outcomes: list[Outcome] = [sandbox.run({"check.py": f"{program}\n\n{test}\n"}, ["check.py"]) for test in tests]
    errors = sum(o.infrastructure_failure for o in outcomes)
    return CodeScore(sum(o.status == PASSED for o in outcomes), len(tests), True, errors)
