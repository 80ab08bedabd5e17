"""Code through the sandbox: the RL reward (the share of a prompt's tests passed, 0 for a program that does not run,
None for a sandbox failure) and the `python` tool in GLM's tool-call format."""

import pytest

from glm46.data.chat import parse_tool_calls
from glm46.data.tools import PythonTool, SandboxUnavailable, environment
from glm46.rl.code_reward import extract_program, score_code
from glm46.sandbox import Limits, Sandbox

pytestmark = pytest.mark.sandbox

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]  # the last is wrong on purpose


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(limits=Limits(wall_seconds=3.0, cpu_seconds=1))


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\n", 2 / 3),
        ("```python\ndef add(a, b):\n    return a + b if a > 0 else 99\n```", 1 / 3),  # runs, passes one
        ("```python\ndef add(a, b)\n    return a + b\n```", 0.0),  # a syntax error: does not run
        ("```python\nimport nonexistent\ndef add(a, b):\n    return a + b\n```", 0.0),  # crashes on import
        ("```python\ndef add(a, b):\n    while True:\n        pass\n```", 0.0),  # every test killed at its bound
    ],
    ids=["right", "partly-wrong", "syntax-error", "crash", "endless"],
)
def test_the_reward_is_the_share_of_tests_passed(sandbox, completion, reward):
    assert score_code(completion, TESTS, sandbox).reward == pytest.approx(reward)


def test_a_sandbox_that_cannot_start_gives_no_reward_not_zero(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    score = score_code("```python\ndef add(a, b):\n    return a + b\n```", TESTS, Sandbox())
    assert score.reward is None and score.sandbox_errors == 1


def test_the_program_is_the_last_python_block():
    assert extract_program("```\nx = 0\n```\n```python\nx = 1\n```\ntext") == "x = 1\n"
    assert extract_program("```\nx = 2\n```") == "x = 2\n"
    assert extract_program("x = 3") == "x = 3"


def test_the_python_tool_serves_a_call_in_glms_format():
    tools = environment(["calculator", "python"])
    turn = "<tool_call>python\n<arg_key>code</arg_key>\n<arg_value>print(6 * 7)</arg_value>\n</tool_call>"
    (call,) = parse_tool_calls(turn, tools.schemas)
    assert call == {"name": "python", "arguments": {"code": "print(6 * 7)"}}
    assert tools.step(call) == "42\n"
    failing = tools.step({"name": "python", "arguments": {"code": "1 / 0"}})
    assert "ZeroDivisionError" in failing and failing.endswith("[exit code 1]")
    slow = PythonTool(limits=Limits(wall_seconds=1.0, cpu_seconds=1))({"code": "import time\ntime.sleep(5)"})
    assert slow.endswith("[timed out after 1 s]")


def test_the_python_tool_raises_where_the_sandbox_cannot_start(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable):
        PythonTool()({"code": "print(1)"})
