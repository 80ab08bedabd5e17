"""BFCL, the Berkeley Function Calling Leaderboard (Patil et al., ICML 2025; github.com/ShishirPatil/gorilla), from the
`bfcl-eval` wheel: its questions, function documents and possible answers (bfcl_eval/data/), scored by BFCL's own
AST checker, as lm-eval tasks that `eval.tasks` names:

    bfcl_simple_python, bfcl_multiple, bfcl_parallel, bfcl_parallel_multiple    BFCL's AST categories
    bfcl_irrelevance                                                              no function fits: no call is right

Each question is rendered by GLM-4.6's chat template with its functions as the tools (BFCL's type names as JSON
schema's, by BFCL's own GORILLA_TO_OPENAPI, as its function-calling handlers convert them); the reply's tool calls,
in GLM's <tool_call> format (glm46.data.chat.parse_tool_calls), are the calls the checker judges; a reply whose
calls do not parse is wrong. The metric is BFCL's accuracy, each question 0 or 1.

bfcl-eval is installed without its dependencies (`make install`): they pin NumPy 1.26 and bring the API clients of
its model handlers, which scoring does not use. The checker reads one flag of a model's handler config (whether the
model's API rewrote `.` in function names as `_`): a config in which no name was rewritten stands in for those
handlers, since GLM's template keeps names as they are.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from glm46.data.chat import parse_tool_calls, render_chat
from glm46.errors import ConfigError

from .lm_eval_tasks import Function, write_task_yaml

CATEGORIES = {
    "bfcl_simple_python": "simple_python",
    "bfcl_multiple": "multiple",
    "bfcl_parallel": "parallel",
    "bfcl_parallel_multiple": "parallel_multiple",
    "bfcl_irrelevance": "irrelevance",
}
GROUP = "bfcl"
VERSION = "BFCL_v4"  # the data files' prefix in bfcl-eval 2026.3.23
MODEL = "glm46"  # the name the checker is told; its stand-in handler config rewrote no function name
INSTALL = "pip install --no-deps bfcl-eval==2026.3.23 (make install does)"


def bfcl_names(names: Sequence[str]) -> list[str]:
    """The BFCL tasks among `names`, the group `bfcl` expanded."""
    found = [n for name in names for n in (list(CATEGORIES) if name == GROUP else [name]) if n in CATEGORIES]
    return list(dict.fromkeys(found))


def data_dir() -> Path | None:
    """bfcl-eval's data folder, or None where it is not installed (found without importing it)."""
    spec = importlib.util.find_spec("bfcl_eval")
    return Path(spec.origin).parent / "data" if spec and spec.origin else None


def check_bfcl(names: Sequence[str]) -> None:
    """A composition that names BFCL tasks needs bfcl-eval's data."""
    wanted = bfcl_names(names)
    folder = data_dir()
    if wanted and (folder is None or not (folder / f"{VERSION}_simple_python.json").is_file()):
        raise ConfigError(f"eval.tasks: {', '.join(wanted)} read BFCL's questions from bfcl-eval: {INSTALL}")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def openapi(schema):
    """A BFCL parameter schema with JSON schema's type names (BFCL's `dict` as `object`, `float` as `number`, ...)."""
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI

    if isinstance(schema, list):
        return [openapi(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    converted = {key: openapi(value) for key, value in schema.items()}
    if isinstance(schema.get("type"), str):
        converted["type"] = GORILLA_TO_OPENAPI.get(schema["type"], schema["type"])
    if isinstance(schema.get("properties"), dict):
        converted["properties"] = {name: openapi(value) for name, value in schema["properties"].items()}
    return converted


def tools_of(functions: list[dict]) -> list[dict]:
    return [{"type": "function", "function": f | {"parameters": openapi(f.get("parameters", {}))}} for f in functions]


def records(category: str) -> list[dict]:
    """BFCL's questions of `category`, each {"id", "prompt" (GLM's template with the tools), "functions", "answer"}
    (the last two as JSON: the checker's function documents and possible answers)."""
    folder = data_dir()
    questions = read_jsonl(folder / f"{VERSION}_{category}.json")
    answers, possible = {}, folder / "possible_answer" / f"{VERSION}_{category}.json"
    if category != "irrelevance":
        answers = {r["id"]: r["ground_truth"] for r in read_jsonl(possible)}
    return [
        {
            "id": q["id"],
            "prompt": render_chat(q["question"][0], tools_of(q["function"]), add_generation_prompt=True),
            "functions": json.dumps(q["function"]),
            "answer": json.dumps(answers.get(q["id"], [])),
            "category": category,
        }
        for q in questions
    ]


@dataclass(frozen=True)
class _HandlerConfig:
    underscore_to_dot: bool = False


@cache
def ast_checker():
    """BFCL's ast_checker, its handlers' config module stood in for (see the module's docstring)."""
    stub = types.ModuleType("bfcl_eval.constants.model_config")
    stub.MODEL_CONFIG_MAPPING = {MODEL: _HandlerConfig()}
    sys.modules.setdefault("bfcl_eval.constants.model_config", stub)
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    return ast_checker


def decoded_calls(reply: str, functions: list[dict]) -> list[dict] | None:
    """The reply's tool calls as BFCL's decoded form [{name: {argument: value}}], or None where they do not parse."""
    try:
        calls = parse_tool_calls(reply.split("<|observation|>")[0], tools_of(functions))
    except ValueError:
        return None
    return [{call["name"]: call["arguments"]} for call in calls]


def is_correct(doc: dict, reply: str) -> bool:
    from bfcl_eval.constants.enums import Language

    functions = json.loads(doc["functions"])
    calls = decoded_calls(reply, functions)
    if doc["category"] == "irrelevance":
        return calls == []
    if not calls:
        return False
    checked = ast_checker()(functions, calls, json.loads(doc["answer"]), Language.PYTHON, doc["category"], MODEL)
    return bool(checked["valid"])


def process_results(doc: dict, results: list[str]) -> dict:
    return {"accuracy": float(is_correct(doc, results[0]))}


def write_bfcl_tasks(names: Sequence[str], folder: Path, max_gen_toks: int) -> list[str]:
    """The BFCL tasks among `names` (the group expanded), each written into `folder` as a YAML over a JSONL of its
    records; returns their names."""
    from glm46.data.chat import STOP_TOKENS

    written, cache = bfcl_names(names), folder.resolve() / "cache"
    for name in written:
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(record) + "\n" for record in records(CATEGORIES[name])))
        write_task_yaml(
            folder / f"{name}.yaml",
            {
                "task": name,
                "tag": [GROUP],
                "dataset_path": "json",
                "dataset_kwargs": {"data_files": {"test": str(data.resolve())}, "cache_dir": str(cache)},
                "test_split": "test",
                "output_type": "generate_until",
                "doc_to_text": "prompt",
                "doc_to_target": "answer",
                "target_delimiter": "",
                "generation_kwargs": {"until": list(STOP_TOKENS), "max_gen_toks": max_gen_toks, "do_sample": False},
                "process_results": Function(f"{__name__}.process_results"),
                "metric_list": [{"metric": "accuracy", "aggregation": "mean", "higher_is_better": True}],
            },
        )
    return written
