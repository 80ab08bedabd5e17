"""Gopher-style quality heuristics (Rae et al. 2021), each threshold a config value.

Length and repetition rules apply to every document; the rules that assume prose (mean word
length, symbol and digit ratios, bullet lines) apply only to `prose_domains`, since code breaks them. Documents of
`exempt_domains` are judged by max_chars alone: preference pairs (source=preference), whose rejected reply may be
short or repetitive on purpose and whose short chat markup (`<think></think>` twice) trips the repetition rules.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from .documents import Document

_WORD = re.compile(r"\S+")


@dataclass
class QualityRules:
    min_chars: int = 32
    max_chars: int = 1_000_000
    max_duplicate_line_fraction: float = 0.3  # share of non-empty lines that repeat an earlier line
    max_top_bigram_fraction: float = 0.2  # characters covered by the most frequent word bigram
    min_words: int = 20  # prose only, from here on
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1  # '#' and '...' per word
    max_digit_fraction: float = 0.25
    max_bullet_line_fraction: float = 0.9
    prose_domains: list[str] = field(default_factory=lambda: ["general", "web", "docs", "license"])
    exempt_domains: list[str] = field(default_factory=lambda: ["preference"])


def violation(doc: Document, rules: QualityRules) -> str | None:
    """The name of the first rule the document breaks, or None."""
    text = doc.text
    if len(text) > rules.max_chars:
        return "max_chars"
    if doc.domain in rules.exempt_domains:
        return None
    if len(text) < rules.min_chars:
        return "min_chars"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and 1 - len(set(lines)) / len(lines) > rules.max_duplicate_line_fraction:
        return "max_duplicate_line_fraction"
    words = _WORD.findall(text)
    if len(words) >= 2:
        top, count = Counter(zip(words, words[1:])).most_common(1)[0]
        if count > 1 and count * (len(top[0]) + len(top[1])) / len(text) > rules.max_top_bigram_fraction:
            return "max_top_bigram_fraction"
    if doc.domain not in rules.prose_domains:
        return None
    if len(words) < rules.min_words:
        return "min_words"
    mean_length = sum(map(len, words)) / len(words)
    if mean_length < rules.min_mean_word_length:
        return "min_mean_word_length"
    if mean_length > rules.max_mean_word_length:
        return "max_mean_word_length"
    if (text.count("#") + text.count("...")) / len(words) > rules.max_symbol_word_ratio:
        return "max_symbol_word_ratio"
    if sum(c.isdigit() for c in text) / len(text) > rules.max_digit_fraction:
        return "max_digit_fraction"
    bullets = sum(line.startswith(("-", "*", "•")) for line in lines)
    if lines and bullets / len(lines) > rules.max_bullet_line_fraction:
        return "max_bullet_line_fraction"
    return None
