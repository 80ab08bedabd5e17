"""Toxicity scored per sentence and kept as a document's maximum, so that one toxic sentence in a long benign
document is found (a document-level score averages it away; Dolma's taggers score spans likewise).

The classifier is alt-profanity-check's: a linear SVM over TF-IDF features, calibrated, trained on human-labelled
clean and offensive text (the Jigsaw toxic-comment Wikipedia comments, among others); its model ships inside the wheel,
so nothing is fetched at run time. Its probabilities are its own: on Python's documentation and license texts, 28 of
97 documents hold a sentence above the seeds' 0.3 ("reversed()" scores 0.64, "kill -9 the daemon" 0.63), none above
0.9 (docs/data.md), so a threshold is measured for the classifier, not carried over from another.
"""

from __future__ import annotations

import hashlib
import re
from importlib import metadata, resources

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def sentences(text: str) -> list[str]:
    """A document's sentences (split after . ! ? and at line breaks), blank ones left out."""
    return [s for s in _SENTENCE_END.split(text) if s.strip()]


def max_toxicity(texts: list[str]) -> list[float]:
    """Per text, the probability of its most offensive sentence (0 for a text without one)."""
    from profanity_check import predict_prob

    split = [sentences(text) for text in texts]
    flat = [s for parts in split for s in parts]
    probabilities = predict_prob(flat).tolist() if flat else []
    found, start = [], 0
    for parts in split:
        found.append(max(probabilities[start : start + len(parts)], default=0.0))
        start += len(parts)
    return found


def classifier() -> dict:
    """The classifier's package, version and the sha256 of its model files (for the manifest)."""
    files = resources.files("profanity_check") / "data"
    digest = hashlib.sha256()
    for name in ("vectorizer.joblib", "model.joblib"):
        digest.update((files / name).read_bytes())
    package = "alt-profanity-check"
    return {"package": package, "version": metadata.version(package), "sha256": digest.hexdigest()}
