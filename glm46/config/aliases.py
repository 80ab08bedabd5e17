"""Command-line names that were renamed, kept working (the README lists them).

The readers of `task=prepare` were members of `data` (`data=jsonl data.paths=[...] data.output_dir=DIR`); they
are the `source` group now (`source=jsonl source.paths=[...] source.output_dir=DIR`), so `data` is only ever a
DataModule. An override list that selects a reader as `data` is rewritten before Hydra composes it.

A module that learns from preference pairs trains alone, not as the last stage of the default run's curriculum:
`module=reward_model` (or `module=dpo`) without an `experiment=` selects the experiment of that name, which sets
its data, phase and callbacks (`python run.py module=reward_model data=preference data.path=DIR init_from=EXPORT`).

The quality classifier's cut is `prepare.quality.min_score` in the design's command-line names; its settings are
the `prepare.quality_classifier` node (`prepare.quality` is the Gopher rules'), so the key is rewritten there.
"""

from __future__ import annotations

SOURCES = ("embedded", "jsonl", "text", "parquet")
STANDALONE_MODULES = ("reward_model", "dpo")  # module=<name> implies experiment=<name>
RENAMED_KEYS = {"prepare.quality.min_score": "prepare.quality_classifier.min_score"}


def renamed_overrides(overrides: list[str]) -> list[str]:
    """`overrides` with RENAMED_KEYS' keys renamed (after any +, ++ or ~), `data=<reader>` as `source=<reader>` and,
    then, every `data.<key>=` as `source.<key>=`; a standalone module without an experiment gets its experiment
    first."""
    overrides = [_renamed_key(o) for o in overrides]
    keys = {o.partition("=")[0] for o in overrides}
    modules = [o.partition("=")[2] for o in overrides if o.partition("=")[0] == "module"]
    if modules and modules[-1] in STANDALONE_MODULES and "experiment" not in keys:
        overrides = [f"experiment={modules[-1]}", *overrides]
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


def _renamed_key(override: str) -> str:
    key, sign, value = override.partition("=")
    prefix = key[: len(key) - len(key.lstrip("+~"))]
    return prefix + RENAMED_KEYS.get(key.removeprefix(prefix), key.removeprefix(prefix)) + sign + value
