"""eval.endpoint: a server that fails is retried, then reported naming it, never scored; the chat API's log-likelihood
tasks and glm46's tool episodes are refused by name before any request (tests/test_serving.py scores a real vLLM)."""

import socket

import pytest

from glm46.errors import ConfigError
from glm46.eval import evaluate
from glm46.eval.endpoint import EndpointError

from .test_eval import compose_run, dataset, model_dir, tool_dataset  # noqa: F401 - the fixtures


def dead_endpoint() -> str:
    with socket.socket() as s:  # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def test_a_server_that_does_not_answer_is_retried_then_reported_and_nothing_is_scored(dataset, model_dir, tmp_path):  # noqa: F811
    endpoint = dead_endpoint()
    settings = [f"eval.dataset={dataset}", f"eval.endpoint={endpoint}", "eval.endpoint_model=served", "eval.limit=2"]
    settings += ["eval.endpoint_retries=2", "eval.endpoint_timeout=5", "eval.tasks=[glm46_arithmetic]"]
    cfg = compose_run(tmp_path, *settings)
    with pytest.raises(EndpointError, match=rf"eval.endpoint={endpoint}: a request failed after 2 tries"):
        evaluate(cfg.eval, model_dir, tmp_path)
    assert not (tmp_path / "eval" / "results.json").exists()
    with pytest.raises(EndpointError, match=r"GET /models failed .*is the server up"):
        evaluate(compose_run(tmp_path, *settings, "eval.endpoint_model=null").eval, model_dir, tmp_path)


def endpoint_run(tmp_path, prepared, *overrides):
    return compose_run(
        tmp_path,
        f"eval.dataset={prepared}",
        f"eval.endpoint={dead_endpoint()}",
        "eval.endpoint_model=served",
        *overrides,
    )


def test_the_chat_apis_log_likelihood_tasks_are_refused_by_name_before_any_request(dataset, model_dir, tmp_path):  # noqa: F811
    cfg = endpoint_run(tmp_path, dataset, "eval.endpoint_api=chat", "eval.tasks=[glm46_arithmetic,glm46_ppl_sft]")
    with pytest.raises(ConfigError, match=r"glm46_ppl_sft scores log-likelihoods \(loglikelihood_rolling\)"):
        evaluate(cfg.eval, model_dir, tmp_path)


def test_tool_episodes_are_refused_for_an_endpoint(tool_dataset, model_dir, tmp_path):  # noqa: F811
    cfg = endpoint_run(tmp_path, tool_dataset, "eval.tasks=[glm46_tool_arithmetic]")
    with pytest.raises(ConfigError, match=r"glm46_tool_arithmetic plays tool episodes.*eval.model"):
        evaluate(cfg.eval, model_dir, tmp_path)
