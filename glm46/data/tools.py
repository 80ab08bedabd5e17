"""Tools that a conversation offers, for the embedded corpus's tool conversations and agentic RL's episodes: their
JSON schemas (as GLM's chat template lists them), a step that serves one parsed call, and the text the model reads.

A well-formed call that a tool cannot serve (an unknown tool, a missing argument, an expression the calculator
refuses) returns an error text to the model, as a real tool would, and the episode goes on; only a call that does
not parse ends it (glm46.data.chat.parse_tool_calls; GLM-4.5's agentic RL gives such a turn reward 0).

The built-in `calculator` evaluates integer arithmetic (+, -, *, exact /, parentheses, unary minus) with a parser of
its own over Python's syntax tree, never `eval`, within limits on the digits of every number and the operations.
The `python` tool runs a program in the sandbox (glm46.sandbox) and returns its output.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from glm46.sandbox import OUTPUT_LIMIT, PASSED, TIMEOUT, Limits, Sandbox


class ToolError(ValueError):
    """A call the tool cannot serve: its message is what the model reads."""


def function_schema(name: str, description: str, argument: str, example: str) -> dict:
    """The JSON schema of a tool with one string argument, as GLM's chat template lists tools."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {argument: {"type": "string", "description": example}},
                "required": [argument],
            },
        },
    }


@dataclass(frozen=True)
class Calculator:
    """`calculator(expression)`: an integer arithmetic expression's value."""

    max_digits: int = 12  # of every number, operands and intermediate results
    max_operations: int = 16
    max_length: int = 200  # characters, checked before parsing

    name = "calculator"

    @property
    def schema(self) -> dict:
        description = "Evaluate an integer arithmetic expression with + - * / and parentheses."
        return function_schema(self.name, description, "expression", "for example 1234 * 56")

    def __call__(self, arguments: dict) -> str:
        if "expression" not in arguments:
            raise ToolError("calculator: missing argument 'expression'")
        return str(self.evaluate(str(arguments["expression"])))

    def evaluate(self, expression: str) -> int:
        if len(expression) > self.max_length:
            raise ToolError(f"calculator: the expression is longer than {self.max_length} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError:
            raise ToolError(f"calculator: cannot read {expression!r}") from None
        operations = sum(isinstance(node, (ast.BinOp, ast.UnaryOp)) for node in ast.walk(tree))
        if operations > self.max_operations:
            raise ToolError(f"calculator: more than {self.max_operations} operations")
        return self._value(tree.body)

    def _value(self, node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return self._checked(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self._value(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            left, right = self._value(node.left), self._value(node.right)
            if isinstance(node.op, ast.Add):
                return self._checked(left + right)
            if isinstance(node.op, ast.Sub):
                return self._checked(left - right)
            if isinstance(node.op, ast.Mult):
                return self._checked(left * right)
            if right == 0 or left % right:
                raise ToolError(f"calculator: {left} / {right} is not an integer")
            return self._checked(left // right)
        raise ToolError("calculator: only integers, + - * / and parentheses")

    def _checked(self, value: int) -> int:
        if len(str(abs(value))) > self.max_digits:
            raise ToolError(f"calculator: a number has more than {self.max_digits} digits")
        return value


@dataclass(frozen=True)
class PythonTool:
    """`python(code)`: the program's output (stdout, then stderr), run in the sandbox (glm46.sandbox: no network, no
    file of this machine, bounded CPU, memory, processes and time). A program that fails, or hits a bound, returns
    what it printed and how it ended, as a terminal would; a sandbox that cannot start raises SandboxUnavailable,
    which ends the episode: an infrastructure failure is never the model's answer."""

    limits: Limits = Limits(wall_seconds=10.0, cpu_seconds=5)
    max_output: int = 2000  # characters of output returned to the model

    name = "python"

    @property
    def schema(self) -> dict:
        description = "Run a Python 3 program (no network, no files but its own) and return what it prints."
        return function_schema(self.name, description, "code", "for example print(2 ** 10)")

    def __call__(self, arguments: dict) -> str:
        if "code" not in arguments:
            raise ToolError("python: missing argument 'code'")
        outcome = Sandbox(limits=self.limits).run({"main.py": str(arguments["code"])}, ["main.py"])
        if outcome.infrastructure_failure:
            raise SandboxUnavailable(f"python: the sandbox did not start: {outcome.stderr.strip()[-300:]}")
        text = outcome.stdout + outcome.stderr
        if len(text) > self.max_output:
            text = text[: self.max_output] + f"... ({len(text) - self.max_output} more characters)"
        ending = {TIMEOUT: f"timed out after {self.limits.wall_seconds:g} s", OUTPUT_LIMIT: "output cut at its bound"}
        if outcome.status in ending:
            return f"{text}\n[{ending[outcome.status]}]"
        return text if outcome.status == PASSED else f"{text}\n[exit code {outcome.returncode}]"


class SandboxUnavailable(RuntimeError):
    """The sandbox could not start (glm46.sandbox): not a failure of the program, nor an answer to score."""


@dataclass
class ToolEnvironment:
    """The tools of an episode: their schemas for the prompt, and `step` to serve one parsed call."""

    tools: list = field(default_factory=lambda: [Calculator()])

    @property
    def schemas(self) -> list[dict]:
        return [tool.schema for tool in self.tools]

    def step(self, call: dict) -> str:
        """A parsed call {"name", "arguments"} -> the text the model reads: the tool's result or its error."""
        tool = next((tool for tool in self.tools if tool.name == call["name"]), None)
        if tool is None:
            return f"error: no tool named {call['name']!r} (tools: {', '.join(t.name for t in self.tools)})"
        try:
            return tool(call["arguments"])
        except ToolError as error:
            return f"error: {error}"


TOOLS = {"calculator": Calculator, "python": PythonTool}  # by the names that tasks and configs give


def environment(names: list[str]) -> ToolEnvironment:
    """The environment offering the named tools (TOOLS)."""
    unknown = sorted(set(names) - TOOLS.keys())
    if unknown:
        raise ValueError(f"unknown tools {unknown}: the built-in ones are {sorted(TOOLS)}")
    return ToolEnvironment(tools=[TOOLS[name]() for name in names])
