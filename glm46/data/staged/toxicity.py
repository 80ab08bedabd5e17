"""The toxicity filter as a stage of a preparation (`prepare.toxicity`, docs/data.md):

    toxicity [N]  per read task, each kept document of the scored `domains` (prose: code never) scored by its most
                  offensive sentence (glm46.data.scorers.toxic_sentences); those above `max` dropped (reason `toxicity`)

It runs after deduplication, the quality rules and the perplexity filter, on what they kept."""

from __future__ import annotations

from pathlib import Path

from glm46.errors import ConfigError

from ..scorers.toxic_sentences import max_toxicity
from .verdicts import judge
from .work import StagedPlan


def check_toxicity(settings: dict | None) -> None:
    """prepare.toxicity.max, before anything runs: a probability (or null: off); a ConfigError naming the key."""
    limit = (settings or {}).get("max")
    if limit is not None and not 0 <= limit < 1:
        raise ConfigError(f"prepare.toxicity.max={limit}: a probability from 0 to below 1 (or null: no filter)")


def toxicity(plan: StagedPlan, reader: int, folder: Path) -> dict:
    limit = plan.toxicity["max"]
    return judge(plan, reader, folder, "toxicity", plan.toxicity["domains"], max_toxicity, lambda v: v > limit)
