"""Every `python run.py ...` line of the README and docs/ composes and validates as written: a command that drifts
from the code (a renamed key, a group that no longer exists, a combination that is refused) fails here.

Each line is read from the Markdown (fenced blocks, with their `\\` continuations, and inline code), as run.py reads
its arguments (glm46.config.restore, glm46.config.aliases), with its placeholders (DIR, FILE, RUN, <SFT export>,
...) given files the tests make: a prepared chat dataset, preference pairs in its tokenizer, an export and a reward
model export of the tiny model in that tokenizer. A full-scale experiment's paths are left missing (its checks read
them when they exist), since a tiny export is not a 355B checkpoint. A sweep (`-m`) is checked at its first point.
"""

import os
import re
import shlex
import shutil
import struct
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.planted_docs import paragraphs
from glm46.config.aliases import renamed_overrides
from glm46.config.checks import validate
from glm46.config.restore import restored_overrides
from glm46.config.values import model_config
from glm46.data.pipeline import prepare_dataset
from glm46.data.preference_task import write_task
from glm46.data.scorers.fasttext_quality import MAGIC, VERSION
from glm46.data.scorers.ngram import fit_kneser_ney
from glm46.data.tokenizer import GLMTokenizer
from glm46.errors import ConfigError
from glm46.hf import save_hf

from .helpers import random_model
from .test_configs import FINE_TUNING, FULL_SCALE
from .test_parallel import compose_layout

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`(python run\.py[^`]*)`")


def documented_commands() -> list[tuple[str, str]]:
    """(page:line, the command's arguments after `python run.py`) of every documented run.py line."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for block in FENCE.finditer(text):
            start = text[: block.start()].count("\n") + 2
            lines = block.group(1).replace("\\\n", " ").split("\n")
            for number, line in enumerate(lines):
                line = line.strip().removeprefix("$ ")
                if line.startswith("python run.py"):
                    found.append((f"{page.name}:{start + number}", line))
        for inline in INLINE.finditer(FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)):
            line = text[: inline.start()].count("\n") + 1
            found.append((f"{page.name}:{line}", " ".join(inline.group(1).split())))
    unique = {}  # a command documented twice is checked once, at its first place
    for where, command in found:
        unique.setdefault(" ".join(shlex.split(command, comments=True)), (where, command))
    return list(unique.values())


COMMANDS = documented_commands()


def arguments(command: str) -> tuple[list[str], bool]:
    """(the overrides of a run.py line, whether it is a sweep), comments and `<same overrides>` (a run's own, which a
    resume restores) dropped."""
    command = re.sub(r"<same overrides>", "", command)
    command = re.sub(r"\$\([^)]*\)", "<its output>", command)  # `serve.python=$(bash scripts/serving_venv.sh)`
    command = re.sub(r"<[^<>]+>", lambda m: m.group(0).replace(" ", "_"), command)  # `<SFT export>`: one word
    words = shlex.split(command, comments=True)
    words = words[words.index("run.py") + 1 :]
    assert "..." not in words, f"{command}: a fragment, not a command (write out the overrides it stands for)"
    overrides = [w for w in words if w not in ("-m", "--multirun")]
    return overrides, any(w in ("-m", "--multirun") for w in words)


def first_point(override: str) -> str:
    """A sweep's override at its first value (`optim.lr=1e-3,3e-3` -> `optim.lr=1e-3`)."""
    key, _, value = override.partition("=")
    if "," in value and not value.startswith(("[", "{", "'[", "'{")):
        value = value.split(",")[0]
    elif value.startswith("range("):  # range(8): 0
        value = value.removeprefix("range(").split(",")[0].rstrip(")") if "," in value else "0"
    return f"{key}={value}"


@pytest.fixture(scope="module")
def files(chat_dataset, tmp_path_factory) -> dict[str, Path]:
    """What the placeholders stand for, made in chat_dataset's tokenizer."""
    root = tmp_path_factory.mktemp("documented")
    tokenizer = GLMTokenizer.from_file(chat_dataset / "tokenizer.json")
    config = model_config(compose_layout("single", ["experiment=toy_stage", "model.vocab_size=512"]))  # the toy model
    export = save_hf(random_model(config, seed=0), root / "run" / "hf", tokenizer=tokenizer).parent
    reward_model = root / "rm"
    shutil.copytree(export, reward_model)
    (reward_model / "hf" / "reward_model.json").write_text("{}")
    pairs, _ = write_task(root / "pairs", pairs=40, prompts=0)
    prepare_dataset("preference", [str(pairs)], root / "pairs-data", default_domain="preference",
                    tokenizer_path=str(chat_dataset / "tokenizer.json"))  # fmt: skip
    documents = root / "docs.jsonl"
    documents.write_text('{"text": "A document."}\n')
    (root / "empty").mkdir()
    fit_kneser_ney(paragraphs()[:20], order=2).write_arpa(root / "model.arpa")  # your own filter models
    # what composition reads of a fastText model: its header (a trained one is hundreds of MB with bigram buckets)
    (root / "model.bin").write_bytes(struct.pack("<ii", MAGIC, VERSION) + bytes(8))
    resumed = root / "out" / "run" / ".hydra"  # the run a resume line names: parallel.md's, written under FSDP2
    resumed.mkdir(parents=True)
    (resumed / "overrides.yaml").write_text(
        "- experiment=tiny_bytes\n- parallelism=fsdp2\n- cluster.devices=4\n- data.batch_size=1\n"
    )
    for benchmark in ("gsm8k", "mmlu", "bbh", "hendrycks_math", "humaneval", "mbpp"):  # eval.benchmark_dir's copies
        (root / "benchmarks" / benchmark).mkdir(parents=True)
        (root / "benchmarks" / benchmark / "test.jsonl").write_text('{"question": "1 + 1?"}\n')
    config = model_config(compose_layout("single", ["experiment=toy_stage"]))  # the default run's model, vocab 8192
    default_export = save_hf(random_model(config, seed=0), root / "default-run" / "hf").parent  # its tokenizer: none
    return {"chat": chat_dataset, "pairs": root / "pairs-data", "export": export, "reward_model": reward_model,
            "pairs_file": pairs, "documents": documents, "tokenizer": chat_dataset / "tokenizer.json",
            "empty": root / "empty", "out": root / "out", "default_export": default_export,
            "arpa": root / "model.arpa", "fasttext": root / "model.bin", "benchmarks": root / "benchmarks"}  # fmt: skip


PLACEHOLDER = re.compile(r"DIR|FILE|RUN|<[^>]+>|outputs/|/ckpt|/data\b|/lustre|/models/|\.\.\.")


def input_folder(root: Path, count: int) -> Path:
    """A folder of `count` one-document files of each file reader (a preparation over that many tasks reads it)."""
    folder = root / f"inputs-{count}"
    if not folder.is_dir():
        folder.mkdir(parents=True)
        for number in range(count):
            (folder / f"part{number}.jsonl").write_text(f'{{"text": "Document {number}."}}\n')
            (folder / f"part{number}.txt").write_text(f"Document {number}.")
            pq.write_table(pa.table({"text": [f"Document {number}."]}), folder / f"part{number}.parquet")
    return folder


def with_files(overrides: list[str], files: dict[str, Path]) -> list[str]:
    """The overrides with each placeholder given a file of `files` (by its key; data.path by the data group, the
    weights by the experiment: the default run's model for its own stages), and `seed=S` a seed."""
    values = dict(o.partition("=")[::2] for o in overrides)
    experiment = next(
        o for o in [*renamed_overrides(overrides), "experiment=toy_recipe_tools"] if o.startswith("experiment=")
    )
    full_scale = experiment.partition("=")[2] in FULL_SCALE | FINE_TUNING or values.get("cluster", "local") not in (
        "local",
        "local_slurm",
    )
    pairs = values.get("data") == "preference" or values.get("module") in ("reward_model", "dpo")
    weights = files["default_export"] if experiment.startswith("experiment=toy_") else files["export"]
    source = values.get("source")
    inputs = files["pairs_file"] if source == "preference" else files["documents"]
    if "DIR" in values.get("source.paths", "") or "*" in values.get("source.paths", ""):  # a folder, a pattern
        inputs = input_folder(files["out"], int(values.get("prepare.tasks", 4)))
    paths = {
        "data.path": files["pairs"] if pairs else files["chat"],
        "init_from": weights,
        "eval.model": weights,
        "serve.model": files["export"],
        "export.model": files["export"],
        "sample.model": files["export"],
        "score.model": files["reward_model"],
        "phase.reward.model": files["reward_model"],
        "sample.reward_model": files["reward_model"],
        "score.data": files["pairs"],
        "eval.dataset": files["chat"],
        "sample.prompts": files["chat"],
        "eval.include_path": files["empty"],
        "eval.benchmark_dir": files["benchmarks"],
        "prepare.tokenizer.path": files["tokenizer"],
        "prepare.perplexity.model": files["arpa"],
        "prepare.quality_classifier.model": files["fasttext"],
        "source.paths": f"[{inputs}]",
        "source.output_dir": files["out"] / "prepared",
        "export.output": files["out"] / "export",
        "sample.output": files["out"] / "samples.jsonl",
        "serve.python": sys.executable,
        "hydra.run.dir": files["out"] / "run",
        "cluster": "local_slurm",
        "seed": 0,
    }
    given = []
    for override in overrides:
        key, sign, value = override.partition("=")
        bare = key.lstrip("+~")
        placeholder = PLACEHOLDER.search(value) or (bare == "seed" and value == "S")
        if bare in paths and sign and placeholder and not value.startswith("@"):
            value = "/ckpt/missing" if full_scale and bare in ("init_from", "data.path") else str(paths[bare])
        given.append(f"{key}{sign}{value}")
    if values.get("task") == "eval" and "eval.dataset" not in values:  # its default: the default run's corpus
        given.append(f"eval.dataset={paths['eval.dataset']}")
    return given


def test_the_documented_commands_are_found():
    assert len(COMMANDS) > 80, COMMANDS[:5]
    for text in ("data=shards data.path=DIR", "hydra.run.dir=RUN ckpt_path=last", "task=eval eval.model=RUN"):
        assert any(text in command for _, command in COMMANDS if command.startswith("python run.py")), text


@pytest.mark.parametrize("where, command", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_documented_command_composes_and_validates(compose_config, files, where, command):
    overrides, sweep = arguments(command)
    if sweep:
        overrides = [first_point(o) for o in overrides]
    overrides = renamed_overrides(restored_overrides(with_files(overrides, files)))
    cfg = compose_config(*[o for o in overrides if not o.startswith("hydra.")])
    try:
        validate(cfg)
    except ConfigError as error:
        if "no llama.cpp venv is built" in str(error) and not os.environ.get("GLM46_REQUIRE_LLAMA_CPP"):
            pytest.skip(str(error))  # CI builds it (scripts/llama_cpp_venv.sh)
        raise
    if cfg.task in ("train", "estimate", "plan", "dryrun"):
        model_config(cfg)
