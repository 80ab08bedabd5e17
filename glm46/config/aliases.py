"""Command-line names that were renamed, kept working (the README lists them).

The readers of `task=prepare` were members of `data` (`data=jsonl data.paths=[...] data.output_dir=DIR`); they
are the `source` group now (`source=jsonl source.paths=[...] source.output_dir=DIR`), so `data` is only ever a
DataModule. An override list that selects a reader as `data` is rewritten before Hydra composes it.
"""

from __future__ import annotations

SOURCES = ("embedded", "jsonl", "text", "parquet")


def renamed_overrides(overrides: list[str]) -> list[str]:
    """`overrides` with `data=<reader>` as `source=<reader>` and, then, every `data.<key>=` as `source.<key>=`."""
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
