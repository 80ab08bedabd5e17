"""Evaluate a served model: `eval.endpoint=http://HOST:PORT/v1`, any OpenAI-compatible server (task=serve's vLLM,
SGLang, a provider), scored on the same tasks as local weights, while training goes on elsewhere.

The requests go through lm-eval's own API models (`local-completions`, `local-chat-completions`): concurrent
(eval.endpoint_concurrency), each with a timeout and retried with exponential backoff (eval.endpoint_retries
attempts). A request that still fails ends the evaluation with an EndpointError naming the server and the failure:
it is never scored as a wrong answer.

- `eval.endpoint_api=completions` (the default) sends token ids, tokenized with the served model's tokenizer (the
  first folder holding a tokenizer.json of eval.endpoint_tokenizer, eval.model's weights and eval.tokenizer's), and
  reads log-likelihoods from the echoed prompt's log-probs.
- `eval.endpoint_api=chat` sends conversations through the server's chat template; it has no prompt log-probs, so
  a log-likelihood task (multiple choice, perplexity) is refused by name before any request.
glm46's tool episodes (a task whose generation_kwargs name `tools`) are played by glm46's own model wrapper only.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from omegaconf import DictConfig

from glm46.errors import ConfigError
from glm46.eval.bfcl import CATEGORIES as BFCL_TASKS

LOGLIKELIHOOD = ("loglikelihood", "multiple_choice", "loglikelihood_rolling")
APIS = {"completions": ("local-completions", "completions"), "chat": ("local-chat-completions", "chat/completions")}


class EndpointError(RuntimeError):
    """The server did not answer a request, after the retries: the evaluation has no result."""


def served_model(endpoint: str, timeout: float) -> str:
    """The first model the server lists (GET <endpoint>/models)."""
    try:
        with urllib.request.urlopen(f"{endpoint.rstrip('/')}/models", timeout=timeout) as response:
            return json.loads(response.read())["data"][0]["id"]
    except (OSError, KeyError, IndexError, ValueError) as error:
        raise EndpointError(f"eval.endpoint={endpoint}: GET /models failed ({error}); is the server up?") from None


def endpoint_model(settings: DictConfig, tokenizer: str | None) -> tuple[str, dict]:
    """(lm-eval's model name, its model_args) for the server at settings.endpoint; `tokenizer`: the served model's
    HF folder (the completions API tokenizes the requests with it)."""
    api = settings.endpoint_api
    if api not in APIS:
        raise ConfigError(f"eval.endpoint_api={api!r}: expected one of {list(APIS)}")
    endpoint = str(settings.endpoint).rstrip("/")
    name, path = APIS[api]
    args = {
        "base_url": f"{endpoint}/{path}",
        "model": settings.endpoint_model or served_model(endpoint, settings.endpoint_timeout),
        "num_concurrent": settings.endpoint_concurrency,
        "max_retries": settings.endpoint_retries,
        "timeout": settings.endpoint_timeout,
        "max_gen_toks": settings.max_gen_toks,
    }
    if settings.max_length:
        args["max_length"] = settings.max_length
    if api == "chat":
        return name, args | {"tokenizer_backend": None, "tokenized_requests": False}
    if tokenizer is None:
        raise ConfigError(
            "eval.endpoint_api=completions tokenizes its requests with the served model's tokenizer: set "
            "eval.endpoint_tokenizer=<its HF folder> (or eval.model)"
        )
    return name, args | {"tokenizer": str(Path(tokenizer).absolute()), "tokenizer_backend": "huggingface"}


def check_endpoint_tasks(tasks: Iterable, api: str) -> None:
    """Refuse, before any request, the tasks a server cannot answer under `api` (lm-eval Task objects)."""
    for task in tasks:
        name, config = task.config.task, task.config
        if api == "chat" and task.OUTPUT_TYPE in LOGLIKELIHOOD:
            raise ConfigError(
                f"eval.tasks: {name} scores log-likelihoods ({task.OUTPUT_TYPE}), which the chat API does not return: "
                "use eval.endpoint_api=completions (its echoed prompt log-probs), or drop the task"
            )
        if api == "chat" and name in BFCL_TASKS:
            raise ConfigError(
                f"eval.tasks: {name}'s prompts are GLM's template with the functions as its tools, which the chat API "
                "would wrap in another: use eval.endpoint_api=completions"
            )
        if (config.generation_kwargs or {}).get("tools"):
            raise ConfigError(
                f"eval.tasks: {name} plays tool episodes, which glm46's own model wrapper serves: evaluate it with "
                "eval.model=<the weights> instead of eval.endpoint"
            )
