"""Code as an RL reward: the share of a prompt's tests that a completion's program passes, each test run with the
program in the sandbox (glm46.sandbox), as HumanEval's and MBPP's checks run it (program, then test, in one
process: the test passes when the process exits 0).

    reward = passed tests / tests            (0 for a program that does not run: a syntax error, a crash on import)
    None  where the sandbox could not start: an infrastructure failure, never scored 0 (open-instruct found 5-15%
          of its "zero" code rewards to be such failures, and masks them)

The program is the completion's last ```python block (or its last ``` block, else the whole completion). Like the
benchmarks' own checks, a program that ends the interpreter before a test's assertion (os._exit(0)) is not told apart
from one that passes; the sandbox bounds what it can do, not what it can claim.

In RL (`Verifier`, the GRPO/PPO stages' verifier) a code prompt is a chat document whose reference reply, which the
policy never sees, holds its tests in a last ```tests block, one statement a line:

    ```tests
    assert add(1, 2) == 3
    assert add(-1, 1) == 0
    ```

Every other prompt keeps glm46.rl.rewards.verify's integer answer. The sandbox is `phase.reward.sandbox`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from glm46.errors import ConfigError
from glm46.rl.rewards import verify
from glm46.sandbox import PASSED, Outcome, Sandbox

_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)
_PYTHON_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.S)
_TESTS_BLOCK = re.compile(r"```tests[ \t]*\n(.*?)```", re.S)


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


def extract_tests(reply: str) -> list[str]:
    """The statements of a reference reply's last ```tests block, one a line ([] where it has none)."""
    blocks = _TESTS_BLOCK.findall(reply)
    return [line for line in blocks[-1].splitlines() if line.strip()] if blocks else []


class Verifier:
    """An RL prompt record's verifier: for a code prompt ({"tests": [...]}) the share of its tests the completion's
    program passes in the sandbox, None where the sandbox failed (the row is left out of the loss, never scored 0);
    otherwise glm46.rl.rewards.verify's 0/1 on {"answer": int}."""

    def __init__(self, sandbox: Sandbox):
        self.sandbox, self.checked = sandbox, False

    def __call__(self, record, completion: str) -> float | None:
        if not record.get("tests"):
            return verify(record, completion)
        if not self.checked:  # at the first code prompt: a data set of integer answers needs no sandbox
            reason = self.sandbox.check()
            if reason:
                raise ConfigError(
                    f"phase.reward.sandbox={self.sandbox.kind}: the RL data holds code prompts and no sandbox can run "
                    f"their programs here: {reason}; or run them unsandboxed with phase.reward.sandbox=none"
                )
            self.checked = True
        return score_code(completion, record["tests"], self.sandbox).reward
