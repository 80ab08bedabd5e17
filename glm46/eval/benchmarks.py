"""lm-eval's own benchmark tasks on local copies of their data: `eval.tasks=[gsm8k, mmlu]` with
`eval.benchmark_dir=DIR`, nothing downloaded (training clusters are often offline).

The tasks are lm-eval's, as bundled (their YAML: prompts, few-shot splits, filters, metrics); only where a task's
data comes from changes. A benchmark named `NAME` reads the Hub dataset(s) its lm-eval folder names (gsm8k:
openai/gsm8k; mmlu: cais/mmlu) from DIR/NAME/, with the Hub dataset's column names, laid out as either
- the Hub's own layout (`huggingface-cli download <dataset> --repo-type dataset --local-dir DIR/NAME`): a folder per
  configuration (gsm8k's `main/`, each MMLU subject) of `<split>-00000-of-00001.parquet` files; or
- JSONL files named by split (`test.jsonl`, `train.jsonl`), in DIR/NAME/ or in a configuration's folder.
A split is the file name up to its first `-` or `.`. Every benchmark named must have its folder, with data files, at
composition (`check_benchmarks`); a split a task needs and its folder lacks is refused when the task loads, naming
the folder.

What a benchmark's checkers read besides its data lies in its folder too (`RESOURCES`): IFEval counts sentences with
NLTK's punkt_tab, read from DIR/ifeval/nltk_data/. A benchmark whose checker cannot be installed beside glm46 is
refused at composition (`UNSUPPORTED`).
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from glm46.errors import ConfigError

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# lm-eval folder -> (a path its checkers read, under DIR/<name>/; how to fetch it where there is a network)
RESOURCES = {
    "ifeval": (
        "nltk_data/tokenizers/punkt_tab/english",
        "python -m nltk.downloader -d DIR/ifeval/nltk_data punkt_tab",
    ),
}
UNSUPPORTED = {
    "minerva_math": "its answer checker needs antlr4-python3-runtime 4.11 and Hydra's OmegaConf pins 4.9; "
    "hendrycks_math (the same MATH problems, scored by string equivalence) runs",
}
_DATASET_PATH = re.compile(r"^\s*dataset_path:\s*['\"]?([^'\"\s#]+)", re.M)


@functools.cache  # the installed lm-eval's configs do not change while glm46 runs
def bundled_entry(name: str):
    """lm-eval's bundled task, group or tag `name` (its index entry), or None. Only the bundled configs that
    mention the name are read: indexing all ~14,000 of them takes 10-20 s."""
    import lm_eval.tasks
    from lm_eval.tasks._index import TaskIndex
    from lm_eval.tasks._yaml_loader import load_yaml

    index = {}
    for path in sorted(Path(lm_eval.tasks.__file__).parent.glob("**/*.yaml")):
        if name.encode() in path.read_bytes():
            with contextlib.suppress(Exception):  # as TaskIndex.build, which skips a config that does not load
                TaskIndex.process_cfg(load_yaml(path, resolve_func=False), path, index)
    return index.get(name)


def tasks_root() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def benchmark_folder(name: str) -> Path | None:
    """The folder of lm-eval's bundled task, group or tag `name` (lm_eval/tasks/<folder>/), or None."""
    entry = bundled_entry(name)
    if entry is None or entry.yaml_path is None:
        return None
    root = tasks_root()
    return root / Path(entry.yaml_path).relative_to(root).parts[0]


def hub_datasets(folder: Path) -> set[str]:
    """The Hub datasets the task files of an lm-eval folder read (their `dataset_path`, templates included)."""
    found = set()
    for path in folder.rglob("*"):
        if path.is_file() and (path.suffix == ".yaml" or "yaml" in path.name):
            found |= {m for m in _DATASET_PATH.findall(path.read_text(errors="replace")) if "/" in m}
    return found


def data_files(folder: Path) -> dict[str, list[str]]:
    """split -> its data files directly in `folder`."""
    splits: dict[str, list[str]] = {}
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if path.is_file() and path.suffix in DATA_SUFFIXES:
            splits.setdefault(re.split(r"[-.]", path.name, maxsplit=1)[0], []).append(str(path))
    return splits


def local_sources(names: Sequence[str], benchmark_dir: str | None, known: Sequence[str] = ()) -> dict[str, Path]:
    """Hub dataset -> its local copy, for each of `names` that is an lm-eval benchmark reading the Hub (not among
    `known`: glm46's own tasks and eval.include_path's). ConfigError naming the folder expected where one is missing."""
    sources = {}
    for name in names:
        folder = None if name in known else benchmark_folder(name)
        if folder is not None and folder.name in UNSUPPORTED:
            raise ConfigError(f"eval.tasks: {name} cannot run: {UNSUPPORTED[folder.name]}")
        datasets = set() if folder is None else hub_datasets(folder)
        if not datasets:
            continue
        hub = ", ".join(sorted(datasets))
        if benchmark_dir is None:
            raise ConfigError(
                f"eval.tasks: {name} is lm-eval's benchmark over the Hub dataset {hub}, and evaluation runs offline: "
                f"copy its files to DIR/{name}/ (the Hub's layout, or <split>.jsonl with its columns) and set "
                "eval.benchmark_dir=DIR"
            )
        local = Path(benchmark_dir) / name
        if not (local.is_dir() and any(path.suffix in DATA_SUFFIXES for path in local.rglob("*"))):
            raise ConfigError(
                f"eval.benchmark_dir={benchmark_dir}: no data for {name} in {local} (expected {hub}'s files there: "
                f"the Hub's layout, e.g. <config>/test-00000-of-00001.parquet, or test.jsonl with its columns)"
            )
        resource, fetch = RESOURCES.get(folder.name, (None, None))
        if resource and not (local / resource).is_dir():
            raise ConfigError(
                f"eval.benchmark_dir={benchmark_dir}: {name}'s checkers read {local / resource}, which is missing "
                f"(fetch it where there is a network with `{fetch}` and copy it there)"
            )
        sources |= dict.fromkeys(datasets, local)
    return sources


@contextlib.contextmanager
def local_copies(sources: dict[str, Path], cache_dir: Path) -> Iterator[None]:
    """Inside the block, the datasets library reads each Hub dataset of `sources` from its local copy (lm-eval's
    tasks call `datasets.load_dataset(path, name, ...)`), its Arrow copy kept in `cache_dir`; every other call is
    left as it is. NLTK also searches each copy's nltk_data/ (`RESOURCES`)."""
    import datasets

    nltk_data = sorted({str(folder / "nltk_data") for folder in sources.values() if (folder / "nltk_data").is_dir()})
    if nltk_data:
        import nltk

        nltk.data.path[:0] = nltk_data

    original = datasets.load_dataset

    def load_dataset(path, name=None, **kwargs):
        if path not in sources:
            return original(path, name, **kwargs)
        folder = sources[path] / name if name and (sources[path] / name).is_dir() else sources[path]
        splits = data_files(folder)
        if not splits:
            raise FileNotFoundError(
                f"{folder}: no <split>.jsonl or <split>-*.parquet files for {path}"
                + (f" (configuration {name})" if name else "")
            )
        builders = {DATA_SUFFIXES[Path(file).suffix] for files in splits.values() for file in files}
        if len(builders) > 1:
            raise ValueError(f"{folder}: JSONL and parquet files mixed; keep one format")
        dropped = ("data_dir", "data_files", "revision", "trust_remote_code", "cache_dir")
        kwargs = {k: v for k, v in kwargs.items() if k not in dropped}
        return original(builders.pop(), data_files=splits, cache_dir=str(cache_dir), **kwargs)

    datasets.load_dataset = load_dataset
    try:
        yield
    finally:
        datasets.load_dataset = original
        if nltk_data:
            nltk.data.path[:] = [path for path in nltk.data.path if path not in nltk_data]
