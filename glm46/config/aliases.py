"""Command-line names that were renamed, kept working (the README lists them).

The readers of `task=prepare` were members of `data` (`data=jsonl data.paths=[...] data.output_dir=DIR`); they
are the `source` group now (`source=jsonl source.paths=[...] source.output_dir=DIR`), so `data` is only ever a
DataModule. An override list that selects a reader as `data` is rewritten before Hydra composes it.

Your own data trains alone, in one stage, not as a stage of the default run's curriculum (whose experiment,
toy_recipe_tools, belongs to `python run.py` on the embedded corpus): without an `experiment=`, naming a data group
selects the one-stage experiment of its kind (ONE_STAGE: `data=sft data.path=DIR init_from=M` is
`experiment=own_sft ...`), and `module=reward_model` (or `module=dpo`) the experiment of that name, which sets its
data, phase and callbacks (`python run.py module=reward_model data=preference data.path=DIR init_from=EXPORT`).

`peft=null` (full fine-tuning, also where an experiment sets adapters) is `peft=none`: Hydra's command line cannot
set a config group to null.

The quality classifier's cut is `prepare.quality.min_score` in the design's command-line names; its settings are
the `prepare.quality_classifier` node (`prepare.quality` is the Gopher rules'), so the key is rewritten there.
"""

from __future__ import annotations

SOURCES = ("embedded", "jsonl", "text", "parquet")
STANDALONE_MODULES = ("reward_model", "dpo")  # module=<name> implies experiment=<name>
# data=<group> -> the experiment that trains it in one stage
ONE_STAGE = {"shards": "own_pretrain", "sft": "own_sft", "rl": "own_rl", "preference": "reward_model"}
RENAMED_KEYS = {"prepare.quality.min_score": "prepare.quality_classifier.min_score"}


def renamed_overrides(overrides: list[str]) -> list[str]:
    """`overrides` with RENAMED_KEYS' keys renamed (after any +, ++ or ~), `data=<reader>` as `source=<reader>` and,
    then, every `data.<key>=` as `source.<key>=`; without an experiment, a standalone module gets its experiment
    first, or else a data group of ONE_STAGE its one-stage experiment."""
    overrides = [_renamed_key(o) for o in overrides]
    overrides = ["peft=none" if o == "peft=null" else o for o in overrides]  # Hydra cannot set a group to null
    if "experiment" not in {o.partition("=")[0] for o in overrides}:
        experiment = _implied_experiment(overrides)
        overrides = [f"experiment={experiment}", *overrides] if experiment else overrides
    if not any(o.partition("=")[::2] in {("data", s) for s in SOURCES} for o in overrides):
        return list(overrides)
    renamed = []
    for override in overrides:
        key, sign, value = override.partition("=")
        if key == "data" and value in SOURCES:
            key = "source"
        elif key.startswith("data."):
            key = "source." + key.removeprefix("data.")
        renamed.append(key + sign + value)
    return renamed


def _implied_experiment(overrides: list[str]) -> str | None:
    """The experiment a standalone module (the last `module=`) or, failing one, a one-stage data group (the last
    `data=`) implies; None for neither."""
    last = {}
    for override in overrides:
        key, _, value = override.partition("=")
        last[key] = value
    if last.get("module") in STANDALONE_MODULES:
        return last["module"]
    return ONE_STAGE.get(last.get("data"))


def _renamed_key(override: str) -> str:
    key, sign, value = override.partition("=")
    prefix = key[: len(key) - len(key.lstrip("+~"))]
    return prefix + RENAMED_KEYS.get(key.removeprefix(prefix), key.removeprefix(prefix)) + sign + value
