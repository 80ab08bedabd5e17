"""Evaluate a model's weights with lm-evaluation-harness, offline: task=eval, and any code that evaluates a
run (glm46.eval.evaluate).

`evaluate` writes the dataset's tasks (glm46.eval.lm_eval_tasks) into <output dir>/eval/tasks/, refuses a task it
cannot run (unknown, or reading its data from the Hub) before loading anything, runs `lm_eval.simple_evaluate`
with the `glm46` model (glm46.eval.harness), then writes <output dir>/eval/results.json (lm-eval's results, as
its CLI writes them) and samples_<task>.jsonl (every request and response), prints lm-eval's tables and logs
`eval/<task>/<metric>` to the given Lightning loggers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

from omegaconf import DictConfig

from glm46.checkpoint.hub_files import find_weights
from glm46.errors import ConfigError
from glm46.eval.benchmarks import benchmark_folder, bundled_entry, local_copies, local_sources
from glm46.eval.bfcl import GROUP as BFCL_GROUP
from glm46.eval.bfcl import write_bfcl_tasks
from glm46.eval.code_tasks import code_task_config, is_code_task, sandboxed
from glm46.eval.endpoint import EndpointError, check_endpoint_tasks, endpoint_model
from glm46.eval.lm_eval_tasks import names_own, prepared, write_task_yaml, write_tasks
from glm46.intervals import interval
from glm46.logs import rank_zero_logger
from glm46.sandbox import Sandbox

log = rank_zero_logger(__name__)

LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")  # the datasets library's readers of local files


def remote_source(config: dict, local: Collection[str] = ()) -> str | None:
    """Where a task config reads its data from when that is not this machine; None for local files, a Hub dataset
    with a local copy among `local` (glm46.eval.benchmarks), or a Python task, whose own code loads its data."""
    path = config.get("dataset_path")
    if path is None or config.get("custom_dataset") or Path(path).is_dir() or path in local:
        return None
    if path not in LOCAL_BUILDERS:
        return f"the Hugging Face Hub dataset {path}"
    files = (config.get("dataset_kwargs") or {}).get("data_files") or []
    files = files.values() if isinstance(files, dict) else [files]
    remote = [f for entry in files for f in ([entry] if isinstance(entry, str) else entry) if "://" in f]
    return remote[0] if remote else None


def unreachable(spec: str | dict, index: dict, local: Collection[str] = ()) -> Iterator[tuple[str, str | None]]:
    """(task, where it reads its data from) for each task that `spec` (a task, group or tag name, or a group's
    inline member) stands for and that reads its data from elsewhere than this machine; (name, None) for a
    name neither in `index` nor among lm-eval's bundled tasks."""
    from lm_eval.tasks._index import Kind

    if isinstance(spec, dict):  # a group's inline member: a task naming its data, a reference to one, or a group
        if "dataset_path" in spec:
            if source := remote_source(spec, local):
                yield str(spec["task"]), source
            return
        for member in spec["task"] if isinstance(spec["task"], list) else [spec["task"]]:
            yield from unreachable(member, index, local)
        return
    entry = index.get(spec)
    if entry is None:
        bundled = bundled_entry(spec)
        hub = "the Hugging Face Hub (lm-eval bundles no data: its tasks download theirs)"
        yield spec, None if bundled is None else (bundled.kind is Kind.TASK and remote_source(bundled.cfg)) or hub
    elif entry.kind in (Kind.TAG, Kind.GROUP):
        for member in sorted(entry.tags) if entry.kind is Kind.TAG else entry.cfg["task"]:
            yield from unreachable(member, index, local)
    elif source := remote_source(entry.cfg, local):
        yield spec, source


def check_tasks(
    names: Sequence[str], index: dict, ours: Sequence[str], include_path: str | None, local: Collection[str] = ()
) -> None:
    """Refuse, before anything loads, an unknown task or one whose data this offline evaluation cannot read (`local`:
    the Hub datasets with local copies)."""
    for name in names:
        for task, source in unreachable(name, index, local):
            if source is None:
                raise ConfigError(
                    f"eval.tasks: unknown task {task!r}: not a glm46 task ({', '.join(ours)}), nor in "
                    f"eval.include_path={include_path}, nor one of lm-eval's bundled tasks"
                )
            raise ConfigError(
                f"eval.tasks: task {task!r}{f' (in {name!r})' if task != name else ''} reads its data from "
                f"{source}, and this evaluation runs offline: ship the data as local files (a task YAML with "
                f"`dataset_path: json` and absolute `data_files`) in a folder given as eval.include_path"
            )


def _is_request_failure(error: BaseException) -> bool:
    """Whether `error` (or its cause) is the HTTP client's: a refused connection, a timeout, an error status."""
    while error is not None:
        if type(error).__module__.split(".")[0] in ("aiohttp", "requests", "urllib3") or isinstance(
            error, TimeoutError
        ):
            return True
        error = error.__cause__ or error.__context__
    return False


def write_code_tasks(names: Sequence[str], folder: Path) -> list[str]:
    """Each of `names` that is one of lm-eval's code tasks, written into `folder` with its programs run in the
    sandbox (glm46.eval.code_tasks); returns those names."""
    written = []
    for name in names:
        entry = bundled_entry(name)
        if entry is not None and entry.yaml_path is not None and is_code_task(entry.cfg):
            write_task_yaml(folder / f"{name}.yaml", code_task_config(entry.cfg, Path(entry.yaml_path)))
            written.append(name)
    return written


def summarize(results: dict) -> dict[str, float]:
    """lm-eval's results as flat `<task>/<metric>` numbers (a filter other than lm-eval's default `none` as
    `<metric>/<filter>`; no stderr), and `<task>/n`, the samples each task was evaluated on."""
    summary = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, kind = key.partition(",")
            if kind and not metric.endswith("_stderr") and isinstance(value, int | float):
                summary[f"{task}/{metric}" + ("" if kind == "none" else f"/{kind}")] = float(value)
        if task in results.get("n-samples", {}):
            summary[f"{task}/n"] = results["n-samples"][task]["effective"]
    return summary


def score_lines(results: dict) -> list[str]:
    """`<task> <metric>: v (95% CI [a, b]) n=N` for every task and metric (`<metric>/<filter>` for a filter other
    than lm-eval's `none`), from each sample's score: Wilson's interval for scores of 0 or 1 (glm46.intervals),
    else the mean's normal interval; none for a metric scored over the whole set (perplexities)."""
    lines = []
    for task, metrics in results["results"].items():
        samples = results.get("samples", {}).get(task, [])
        for key, value in metrics.items():
            metric, _, kind = key.partition(",")
            if not kind or metric.endswith("_stderr") or not isinstance(value, int | float):
                continue
            scores = [
                s[metric] for s in samples if s.get("filter", "none") == kind and isinstance(s.get(metric), int | float)
            ]
            name = metric if kind == "none" else f"{metric}/{kind}"
            if not scores:
                lines.append(f"{task} {name}: {value:.4f}")
                continue
            n = len(scores)
            if all(score in (0, 1) for score in scores):
                low, high = interval(sum(scores) / n, n)
            else:
                mean = sum(scores) / n
                half = 1.96 * (sum((x - mean) ** 2 for x in scores) / max(n - 1, 1) / n) ** 0.5
                low, high = mean - half, mean + half
            lines.append(f"{task} {name}: {value:.4f} (95% CI [{low:.4f}, {high:.4f}]) n={n}")
    return lines


def save(results: dict, folder: Path) -> None:
    """results.json without the samples, and each task's samples as samples_<task>.jsonl, as lm-eval's CLI."""
    from lm_eval.utils import handle_non_serializable

    def dump(value, **options) -> str:
        return json.dumps(value, default=handle_non_serializable, ensure_ascii=False, **options)

    (folder / "results.json").write_text(dump({k: v for k, v in results.items() if k != "samples"}, indent=2))
    for task, samples in results["samples"].items():
        (folder / f"samples_{task}.jsonl").write_text("".join(dump(sample) + "\n" for sample in samples))


@contextlib.contextmanager
def quiet_harness() -> Iterator[None]:
    """lm-eval's INFO lines (seeds, the task list, context building: dozens per evaluation) and the datasets library's
    "Generating test split" bars, held back; lm-eval's warnings and its results table still show."""
    import datasets

    harness = logging.getLogger("lm_eval")
    level, bars = harness.level, datasets.is_progress_bar_enabled()
    harness.setLevel(logging.WARNING)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        harness.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def evaluate(
    settings: DictConfig, model: str | Path | None, output_dir: Path, loggers: Sequence = (), step: int | None = None
) -> dict:
    """Evaluate the weights at `model` (an HF directory, or a run directory with hf/), or the server at
    settings.endpoint (glm46.eval.endpoint; `model` then gives its tokenizer, or None), on settings.tasks; return
    lm-eval's results (with their `samples`). Writes <output_dir>/eval/: tasks/, results.json, samples_*.jsonl.
    The loggers get `eval/<task>/<metric>` at `step` (a training run's last step)."""
    for switch in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # read when huggingface_hub and datasets load
        os.environ.setdefault(switch, "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    import glm46.eval.harness  # noqa: F401 - registers the `glm46` model

    start, folder = time.perf_counter(), Path(output_dir) / "eval"
    (folder / "tasks").mkdir(parents=True, exist_ok=True)
    # glm46's own tasks, where named or where their dataset is there (an unknown task's error lists them)
    ours = write_tasks(settings, folder / "tasks") if names_own(settings.tasks) or prepared(settings.dataset) else []
    ours += write_bfcl_tasks(settings.tasks, folder / "tasks", settings.max_gen_toks)  # glm46's tasks of BFCL's data
    ours += [BFCL_GROUP] if BFCL_GROUP in settings.tasks else []
    sources = local_sources([t for t in settings.tasks if t not in ours], settings.get("benchmark_dir"))
    code = write_code_tasks([t for t in settings.tasks if t not in ours], folder / "tasks")
    folders = [benchmark_folder(t) for t in settings.tasks if t not in ours + code]
    benchmarks = sorted({str(folder) for folder in folders if folder is not None})
    include = [str(folder / "tasks"), *([settings.include_path] if settings.include_path else [])]
    manager = TaskManager(include_path=include + (benchmarks if sources else []), include_defaults=False)
    check_tasks(list(settings.tasks), manager.task_index, ours, settings.include_path, sources)
    if settings.get("endpoint"):  # a served model (glm46.eval.endpoint)
        candidates = [settings.get("endpoint_tokenizer"), find_weights(model) if model else None]
        candidates.append(Path(settings.tokenizer).parent if settings.tokenizer else None)  # eval.tokenizer's folder
        tokenizer = next((c for c in candidates if c and (Path(c) / "tokenizer.json").is_file()), None)
        model_name, model_args = endpoint_model(settings, tokenizer)
    else:
        model_name = "glm46"
        model_args = {
            "pretrained": str(Path(model).absolute()),
            "tokenizer": settings.tokenizer,
            "max_length": settings.max_length,
            "max_gen_toks": settings.max_gen_toks,
        }
    seed = settings.seed
    sandbox = Sandbox(kind=settings.get("sandbox", "bubblewrap"))
    with quiet_harness(), local_copies(sources, folder / "cache"), sandboxed(sandbox) as counts:
        if settings.get("endpoint"):
            check_endpoint_tasks(manager.load(list(settings.tasks))["tasks"].values(), settings.endpoint_api)
        try:
            results = simple_evaluate(
                model=model_name,
                model_args=model_args,
                tasks=list(settings.tasks),
                batch_size=settings.batch_size,
                limit=settings.limit,
                bootstrap_iters=0,
                task_manager=manager,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
                apply_chat_template=settings.get("endpoint") is not None and settings.endpoint_api == "chat",
                gen_kwargs=dict(settings.gen_kwargs) if settings.get("gen_kwargs") else None,
            )
        except Exception as error:
            if settings.get("endpoint") and _is_request_failure(error):
                raise EndpointError(
                    f"eval.endpoint={settings.endpoint}: a request failed after {settings.endpoint_retries} tries "
                    f"({type(error).__name__}: {error}); no result is written"
                ) from error
            raise
    if code:  # programs the sandbox could not start: no score, counted apart (never a failed test)
        results["sandbox_errors"] = counts["sandbox_errors"]
        if counts["sandbox_errors"]:
            log.warning(
                f"{counts['sandbox_errors']} documents of {', '.join(code)} left out: the sandbox did not start"
            )
    save(results, folder)
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    print("\n".join(score_lines(results)))
    metrics = {f"eval/{key}": value for key, value in summarize(results).items()}
    for logger in loggers:
        logger.log_metrics(metrics, step=step)
        logger.save()
    log.info(f"evaluated {model} in {time.perf_counter() - start:.1f} s: {folder / 'results.json'}")
    return results
