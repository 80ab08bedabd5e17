"""An experiment's stages as a graph (glm46.app.curriculum runs them): what each stage makes, what it needs, and which
stages can run side by side.

A stage is a list of command-line overrides; its task says what it makes, in its directory `<run dir>/stages/<name>/`:

    train   (the default)    weights: hf/
    sample  (task=sample)    chat JSONL of rejection sampling: samples.jsonl (and its manifest)
    prepare (task=prepare)   a prepared dataset: data/

`@name` in an override's value, alone, followed by a path (`@cold_start/tokenizer.json`) or as an item of a list
(`source.paths=[@sample_a,@sample_b]`), is that stage's product. A stage depends on the stages it names, and a
training stage that names no `init_from` on the training stage listed before it (it starts from its weights). A
stage may only name stages listed before it, so the listed order is an order to run them in; the stages whose
dependencies all ran before form a wave: one cluster job each, side by side.
"""

from __future__ import annotations

import re
from pathlib import Path

from glm46.errors import ConfigError

PRODUCTS = {"train": "hf", "sample": "samples.jsonl", "prepare": "data"}
REFERENCE = re.compile(r"(?:(?<=^)|(?<=[\[,=]))@(\w+)")  # @name at a value's start or a list item's


def stage_kind(overrides: list[str]) -> str:
    """train, sample or prepare: the stage's `task=` (the last one it gives)."""
    tasks = [o.partition("=")[2] for o in overrides if o.partition("=")[0] == "task"]
    kind = tasks[-1] if tasks else "train"
    if kind not in PRODUCTS:
        raise ConfigError(f"a stage's task={kind}: stages train, sample or prepare")
    return kind


def product(run_dir: Path, name: str, kind: str) -> Path:
    """What stage `name` of kind `kind` makes in the run `run_dir`."""
    return run_dir / "stages" / name / PRODUCTS[kind]


def references(overrides: list[str]) -> list[str]:
    """The stages an override list names (`@name`), in order, once each."""
    names = [match for override in overrides for match in REFERENCE.findall(override.partition("=")[2])]
    return list(dict.fromkeys(names))


def resolved(overrides: list[str], run_dir: Path, kinds: dict[str, str]) -> list[str]:
    """The overrides with each `@name` that stage's product (a stage not in `kinds` is a training stage)."""

    def value(text: str) -> str:
        return REFERENCE.sub(lambda m: str(product(run_dir, m.group(1), kinds.get(m.group(1), "train"))), text)

    return [f"{key}={value(rest)}" if sign else key for key, sign, rest in (o.partition("=") for o in overrides)]


def with_output(kind: str, overrides: list[str], stage_dir: Path) -> list[str]:
    """A sample or prepare stage's overrides with its product in its directory."""
    if kind == "sample":
        return [*overrides, f"sample.output={stage_dir / PRODUCTS['sample']}"]
    if kind == "prepare":
        return [*overrides, f"source.output_dir={stage_dir / PRODUCTS['prepare']}"]
    return overrides


def dependencies(stages: dict[str, list[str]], final: list[str] | None = None) -> dict[str, list[str]]:
    """Each stage's (and, as `final`, the composition's: its own overrides) stages it needs, in listed order;
    ConfigError for a name that is not an earlier stage."""
    order = list(stages)
    needs, last_train = {}, None
    for position, (name, overrides) in enumerate([*stages.items(), *([("final", final)] if final is not None else [])]):
        named = references(overrides)
        for other in named:
            if other not in order[:position]:
                raise ConfigError(
                    f"stage {name}: @{other} names no stage listed before it (stages: {', '.join(order) or 'none'})"
                )
        kind = stage_kind(overrides)
        starts = [o for o in overrides if o.startswith("init_from=")]
        implicit = [last_train] if kind == "train" and not starts and last_train is not None else []
        needs[name] = list(dict.fromkeys(implicit + named))
        last_train = name if kind == "train" else last_train
    return needs


def waves(needs: dict[str, list[str]]) -> list[list[str]]:
    """The stages in waves: each wave's stages need only stages of earlier waves, and so can run side by side."""
    level: dict[str, int] = {}
    for name, needed in needs.items():  # listed order: every needed stage is levelled already
        level[name] = 1 + max((level[other] for other in needed), default=-1)
    return [[name for name in needs if level[name] == k] for k in range(max(level.values(), default=-1) + 1)]


def format_waves(needs: dict[str, list[str]], kinds: dict[str, str]) -> str:
    """The waves, one line each: `2. reward_model (train), expert_tool (train)`."""
    lines = [
        f"  {k + 1}. " + ", ".join(f"{name} ({kinds.get(name, 'train')})" for name in wave)
        for k, wave in enumerate(waves(needs))
    ]
    return "stages side by side (each wave needs only the waves before it):\n" + "\n".join(lines)


def teachers(name: str, needs: dict[str, list[str]], kinds: dict[str, str], stages: dict[str, list[str]]) -> list[str]:
    """The training stages whose samples a stage's data holds: the models of the sample stages upstream of it through
    sample and prepare stages (a unified model's experts)."""
    found, queue = [], [n for n in needs[name] if kinds.get(n) in ("sample", "prepare")]
    while queue:
        other = queue.pop(0)
        for upstream in needs[other]:
            if kinds[upstream] == "train" and kinds[other] == "sample" and upstream in sample_models(stages[other]):
                found.append(upstream)
            elif kinds[upstream] in ("sample", "prepare"):
                queue.append(upstream)
    return list(dict.fromkeys(found))


def sample_models(overrides: list[str]) -> list[str]:
    """The stages a sample stage samples from (its sample.model)."""
    return references([o for o in overrides if o.startswith("sample.model=")])
