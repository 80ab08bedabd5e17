"""The settings of every model-based filter of a preparation, checked before anything runs (at composition for
run.py, at the start of prepare_dataset)."""

from __future__ import annotations

from .classifier import check_quality_classifier
from .perplexity import check_perplexity
from .semantic import check_semantic_dedup
from .toxicity import check_toxicity


def check_filters(settings: dict) -> None:
    """prepare's filter nodes (a ConfigError naming the key for one that cannot run; a missing node is off)."""
    check_perplexity(settings.get("perplexity"))
    check_quality_classifier(settings.get("quality_classifier"))
    check_toxicity(settings.get("toxicity"))
    check_semantic_dedup(settings.get("semantic_dedup"))
