"""The settings of every model-based filter of a preparation, checked before anything runs (at composition for
run.py, at the start of prepare_dataset)."""

from __future__ import annotations

from glm46.errors import ConfigError

from ..cache import filter_on
from .classifier import check_quality_classifier
from .perplexity import check_perplexity
from .semantic import check_semantic_dedup
from .toxicity import check_toxicity

# The filters that score with a model fitted on reference domains or given as a file, and the keys asking them to drop
DROP_KEYS = {"perplexity": ("max",), "quality_classifier": ("min_score", "keep_fraction")}


def check_filters(settings: dict) -> None:
    """prepare's filter nodes (a ConfigError naming the key for one that cannot run; a missing node is off)."""
    for name, keys in DROP_KEYS.items():
        node = settings.get(name) or {}
        asked = next((key for key in keys if node.get(key) is not None), None)
        if asked and not filter_on(name, node):  # it would be off: the cut asked for would silently do nothing
            raise ConfigError(
                f"prepare.{name}.{asked}={node[asked]}: no model to score with; set prepare.{name}.reference_domains="
                f"[...] or source.reference_domains=[...] (domains of edited prose to fit it on) or "
                f"prepare.{name}.model=FILE"
            )
    check_perplexity(settings.get("perplexity"))
    check_quality_classifier(settings.get("quality_classifier"))
    check_toxicity(settings.get("toxicity"))
    check_semantic_dedup(settings.get("semantic_dedup"))
