"""lm-eval's code benchmarks (humaneval, mbpp and their variants: the bundled tasks marked `unsafe_code`) with their
programs run in the sandbox (glm46.sandbox) instead of lm-eval's `exec` behind HF_ALLOW_CODE_EVAL.

Each such task is lm-eval's own YAML (prompts, stop strings, few-shot samples, the filters that build each program)
with one change: its pass@k is glm46's, each sample's program and the task's tests run in a sandbox of their own,
with the unbiased estimator over n samples (Chen et al. 2021, arXiv:2107.03374):

    pass@k = 1 - C(n - c, k) / C(n, k)        c: the samples whose program passed

The filters are lm-eval's functions, read from its utils.py (which loads HF evaluate's `code_eval` from the Hub at
import: a stub stands in for it, so nothing is downloaded). A program the sandbox could not start is no score: the
sample is left out of the mean and counted (`sandbox_errors`), never scored 0. The sandbox is set for the length
of an evaluation (`sandboxed`): `eval.sandbox=bubblewrap` (the default; refused at composition where it cannot run)
or `none`, said explicitly.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
import types
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from glm46.sandbox import PASSED, Sandbox

from .lm_eval_tasks import Function

_state = {"sandbox": None, "sandbox_errors": 0}


def is_code_task(config: dict) -> bool:
    return bool(config.get("unsafe_code"))


@contextlib.contextmanager
def sandboxed(sandbox: Sandbox) -> Iterator[dict]:
    """The sandbox the code tasks' pass@k runs programs in, inside the block; yields the counts (sandbox_errors)."""
    _state.update(sandbox=sandbox, sandbox_errors=0)
    try:
        yield _state
    finally:
        _state["sandbox"] = None


def estimate_pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of c passing samples among n (human-eval's estimator, as a stable product)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k(references: list[str], predictions: list[list[str] | str], k: int | list[int] = 1) -> dict:
    """lm-eval's per-document metric: {"pass@<k>": value} for each k, or None where the sandbox failed."""
    sandbox = _state["sandbox"]
    if sandbox is None:
        raise RuntimeError("a code task's pass@k runs outside glm46.eval.code_tasks.sandboxed(...)")
    (tests,), (programs,) = references, predictions
    programs = [programs] if isinstance(programs, str) else programs  # unfiltered: the reply itself (mbpp)
    outcomes = [sandbox.run({"check.py": f"{program}\n\n{tests}\n"}, ["check.py"]) for program in programs]
    ks = [k] if isinstance(k, int) else list(k)
    if any(outcome.infrastructure_failure for outcome in outcomes):
        _state["sandbox_errors"] += 1
        return {f"pass@{each}": None for each in ks}
    passed = sum(outcome.status == PASSED for outcome in outcomes)
    return {f"pass@{each}": estimate_pass_at_k(len(programs), passed, each) for each in ks}


def pass_at_1(references: list[str], predictions: list[list[str]]) -> dict:
    return pass_at_k(references, predictions, 1)


def mean_of_scored(scores: list[float | None]) -> float:
    """The mean over the documents whose programs ran (a sandbox failure is no score)."""
    scored = [score for score in scores if score is not None]
    return sum(scored) / len(scored) if scored else float("nan")


@cache
def lm_eval_utils(folder: str) -> types.ModuleType:
    """lm-eval's utils.py of a code benchmark's folder, imported with a stub for HF evaluate (its import-time
    `evaluate.load("code_eval")` would download the metric and exec a test program)."""
    stub = types.ModuleType("evaluate")

    class _Metric:
        def compute(self, references, predictions, k=(1,)):
            return {f"pass@{each}": 0.0 for each in k}, {}

    stub.load = lambda *args, **kwargs: _Metric()
    saved = sys.modules.get("evaluate")
    sys.modules["evaluate"] = stub
    try:
        spec = importlib.util.spec_from_file_location(
            f"glm46_lm_eval_utils_{Path(folder).name}", Path(folder) / "utils.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            sys.modules.pop("evaluate", None)
        else:
            sys.modules["evaluate"] = saved
    return module


UTILS = "utils_of_"  # `utils_of_<folder>__<function>`: a function of lm-eval's utils.py in tasks/<folder>/


def __getattr__(name: str):
    """`utils_of_<folder>__<function>`: lm-eval's function of that code benchmark's utils.py (what a task YAML
    written by `code_task_config` names for its filters and few-shot samples)."""
    folder, separator, function = name.removeprefix(UTILS).partition("__")
    if not name.startswith(UTILS) or not separator:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .benchmarks import tasks_root

    return getattr(lm_eval_utils(str(tasks_root() / folder)), function)


def code_task_config(config: dict, yaml_path: Path) -> dict:
    """lm-eval's raw task config (functions unresolved: `<path>/utils.<function>`) with its pass@k glm46's and its
    other functions read from lm-eval's utils.py through this module."""
    folder = yaml_path.parent.name

    def resolved(value):
        if isinstance(value, dict):
            return {key: resolved(v) for key, v in value.items()}
        if isinstance(value, list):
            return [resolved(v) for v in value]
        if isinstance(value, str) and value.startswith(str(yaml_path.parent)) and ".utils." in f".{Path(value).name}":
            return Function(f"{__name__}.{UTILS}{folder}__{value.rpartition('.')[2]}")
        return value

    task = resolved({key: value for key, value in config.items() if key != "unsafe_code"})
    metrics = []
    for metric in task["metric_list"]:
        k = metric.get("k", 1)
        metrics.append({"metric": Function(f"{__name__}.pass_at_k"), "k": k,
                        "aggregation": Function(f"{__name__}.mean_of_scored"), "higher_is_better": True})  # fmt: skip
    return task | {"metric_list": metrics}
