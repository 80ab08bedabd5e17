"""BFCL from the bfcl-eval wheel (glm46.eval.bfcl): every question's ground truth, written as GLM's template writes
tool calls, passes BFCL's own AST checker, and a changed argument, a missing call or a call where none fits does not;
`eval.tasks=[bfcl_...]` evaluates an export with its scores and intervals; without bfcl-eval it is refused at
composition."""

import io
import json
from contextlib import redirect_stdout

import pytest

from glm46.config.checks import validate
from glm46.data.chat import render_chat
from glm46.errors import ConfigError
from glm46.eval import bfcl, evaluate

from .test_benchmarks import model_dir  # noqa: F401 - the fixture
from .test_eval import compose_run, dataset  # noqa: F401 - the fixture

AST = ["simple_python", "multiple", "parallel", "parallel_multiple"]


def option(values, required: bool = False):
    """A possible answer's first accepted value; None to leave an optional argument out (where "" is accepted)."""
    if "" in values and not required:
        return None
    return resolved(next(value for value in values if value != ""))


def resolved(value):
    if isinstance(value, dict):  # a dict argument's keys hold lists of accepted values again
        return {key: chosen for key, options in value.items() if (chosen := option(options)) is not None}
    if isinstance(value, list):
        return [resolved(item) for item in value]
    return value


def reply(answer: list[dict], functions: list[dict]) -> str:
    """The ground truth's calls as GLM-4.6's template writes an assistant's tool calls."""
    required = {f["name"]: set(f.get("parameters", {}).get("required", [])) for f in functions}
    calls = []
    for call in answer:
        for name, arguments in call.items():
            chosen = {key: option(values, key in required.get(name, ())) for key, values in arguments.items()}
            calls.append({"function": {"name": name, "arguments": {k: v for k, v in chosen.items() if v is not None}}})
    text = render_chat([{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": calls}])
    return text[text.index("<tool_call>") : text.rindex("</tool_call>") + len("</tool_call>")] + "<|observation|>"


@pytest.mark.parametrize("category", AST)
def test_every_ground_truth_in_glms_format_passes_bfcls_checker(category):
    records = bfcl.records(category)
    assert len(records) >= 200 and records[0]["prompt"].endswith("<|assistant|>")
    written = {r["id"]: reply(json.loads(r["answer"]), json.loads(r["functions"])) for r in records}
    failed = [r["id"] for r in records if not bfcl.is_correct(r, written[r["id"]])]
    assert not failed, failed


def test_a_wrong_argument_a_missing_call_and_a_call_where_none_fits_are_wrong():
    record = next(r for r in bfcl.records("simple_python") if r["id"] == "simple_python_0")  # base 10, height 5
    right = reply(json.loads(record["answer"]), json.loads(record["functions"]))
    assert bfcl.is_correct(record, right)
    assert not bfcl.is_correct(record, right.replace("<arg_value>10</arg_value>", "<arg_value>11</arg_value>"))
    assert not bfcl.is_correct(record, "The area is 25.")
    assert not bfcl.is_correct(record, "<tool_call>calculate_triangle_area<arg_key>base")  # does not parse
    irrelevant = bfcl.records("irrelevance")[0]
    assert bfcl.is_correct(irrelevant, "None of these functions can answer that.")
    assert not bfcl.is_correct(irrelevant, right)


@pytest.mark.slow
def test_bfcl_tasks_evaluate_an_export(dataset, model_dir, tmp_path):  # noqa: F811
    """Benchmarks alone need no eval.dataset (glm46's own tasks are written from it only when named)."""
    missing = tmp_path / "no-dataset"
    overrides = [f"eval.dataset={missing}", f"eval.tokenizer={dataset}/tokenizer.json", "eval.limit=3",
                 "eval.tasks=[bfcl_simple_python,bfcl_irrelevance]"]  # fmt: skip
    cfg = compose_run(tmp_path, *overrides, "eval.max_gen_toks=8", "eval.max_length=1024", "eval.batch_size=3")
    with redirect_stdout(io.StringIO()) as printed:
        results = evaluate(cfg.eval, model_dir, tmp_path)
    assert {task: results["n-samples"][task]["effective"] for task in results["results"]} == {
        "bfcl_simple_python": 3,
        "bfcl_irrelevance": 3,
    }
    assert "bfcl_simple_python accuracy: 0.0000 (95% CI [" in printed.getvalue()  # a random model calls nothing
    assert results["results"]["bfcl_irrelevance"]["accuracy,none"] == 1.0  # and so answers these right
    with pytest.raises(ConfigError, match=rf"names glm46's own tasks, written from eval.dataset={missing}, which is"):
        validate(compose_run(tmp_path, f"eval.model={model_dir}", f"eval.dataset={missing}", "eval.tasks=[glm46]"))


def test_bfcl_without_bfcl_eval_is_refused_at_composition(dataset, model_dir, tmp_path, monkeypatch):  # noqa: F811
    base = [f"eval.model={model_dir}", f"eval.dataset={dataset}", "eval.tasks=[bfcl]"]
    validate(compose_run(tmp_path, *base))
    monkeypatch.setattr(bfcl, "data_dir", lambda: None)
    with pytest.raises(ConfigError, match=r"bfcl_simple_python, .*bfcl_irrelevance read BFCL's .*--no-deps bfcl-eval"):
        validate(compose_run(tmp_path, *base))
