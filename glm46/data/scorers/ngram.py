"""A word n-gram language model for CCNet's perplexity filter (Wenzek et al., 2019, arXiv:1911.00359): fitted with
interpolated Kneser-Ney on reference documents, written in ARPA (the format KenLM loads) and scored per word.

CCNet scores each document with a 5-gram KenLM model of Wikipedia: a document far from the reference text (word
salad, boilerplate, gibberish) has a high perplexity. Its perplexity is `10 ** (-sum of log10 p / words)`, with
every line a sentence (`<s> words </s>`, the `</s>` counted as a word). What a value means depends on the model and
its reference text: the seeds' `perplexity < 500` is a threshold for one model, not for this one; CCNet's percentile
buckets (head, middle, tail of the scored pool) carry over to any model.

KenLM's `lmplz` (not in its pip package) is what fits large models; this fit is KenLM's estimate in its simplest form
(one discount per order, Ney's D = n1 / (n1 + 2 n2) of the adjusted counts), for reference domains of megabytes.
KenLM loads what `write_arpa` writes and scores as `log10_prob` does (tested); the preparation scores with it
(`KenLMScorer`).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
NEVER = -99.0  # ARPA's log10 probability of what is never predicted (<s>)
_WORD = re.compile(r"\w+|[^\w\s]")


def words(line: str) -> list[str]:
    """CCNet's normalisation, in short: lower case, every digit 0, words and punctuation marks apart."""
    return _WORD.findall(re.sub(r"\d", "0", line.lower()))


def sentences(text: str) -> Iterator[list[str]]:
    """A document's non-empty lines as word lists: CCNet scores a document line by line."""
    for line in text.split("\n"):
        if tokens := words(line):
            yield tokens


@dataclass
class NGramModel:
    """An ARPA model: log10 probabilities of the n-grams it lists, and back-off weights of their contexts."""

    order: int
    logprob: dict[tuple[str, ...], float]
    backoff: dict[tuple[str, ...], float]

    def log10_prob(self, context: tuple[str, ...], word: str) -> float:
        """log10 p(word | context) with ARPA's back-off: the longest listed n-gram, plus the back-off weights of the
        longer contexts that were not listed with the word; a word the model does not know is <unk>."""
        word = word if (word,) in self.logprob else UNK
        context, penalty = context[len(context) - self.order + 1 :] if self.order > 1 else (), 0.0
        for start in range(len(context) + 1):
            history = context[start:]
            if (found := self.logprob.get(history + (word,))) is not None:
                return penalty + found
            penalty += self.backoff.get(history, 0.0)
        raise AssertionError(f"{word!r} has no unigram")  # every model lists <unk>

    def sentence_log10(self, tokens: list[str]) -> float:
        """log10 p(tokens </s> | <s>)."""
        context, total = (BOS,), 0.0
        for token in tokens + [EOS]:
            total += self.log10_prob(context, token)
            context = (context + (token,))[-(self.order - 1) :] if self.order > 1 else ()
        return total

    def perplexity(self, text: str) -> float:
        return document_perplexity(self.sentence_log10, text)

    def write_arpa(self, path: str | Path) -> None:
        """The model in ARPA (n-grams sorted within each order)."""
        by_order = defaultdict(list)
        for gram in self.logprob:
            by_order[len(gram)].append(gram)
        lines = ["", "\\data\\"] + [f"ngram {n}={len(by_order[n])}" for n in range(1, self.order + 1)]
        for n in range(1, self.order + 1):
            lines += ["", f"\\{n}-grams:"]
            for gram in sorted(by_order[n]):
                weight = self.backoff.get(gram)
                line = f"{self.logprob[gram]:.7g}\t{' '.join(gram)}"
                lines.append(line if weight is None else f"{line}\t{weight:.7g}")
        lines += ["", "\\end\\", ""]
        Path(path).write_text("\n".join(lines), encoding="utf-8")


def arpa_counts(path: str | Path) -> dict[int, int]:
    """The n-gram counts an ARPA file declares in its header (`\\data\\`, then `ngram N=count` lines): what is
    checked of a given model before anything runs, without reading its n-grams; ValueError where there is none."""
    counts: dict[int, int] = {}
    with open(path, encoding="utf-8") as f:
        lines = (raw.strip() for raw in f)
        opening = next((line for line in lines if line), "")
        if opening != "\\data\\":
            raise ValueError(f"{path}: an ARPA file opens with \\data\\, not {opening[:40]!r}")
        for line in lines:
            if not line.startswith("ngram ") or "=" not in line:
                break
            order, count = line[len("ngram ") :].split("=")
            counts[int(order)] = int(count)
    if not counts:
        raise ValueError(f"{path}: no n-gram counts after \\data\\")
    return counts


def document_perplexity(sentence_log10, text: str) -> float:
    """CCNet's document perplexity: 10 ** (-sum of its lines' log10 p / their words, each </s> one of them);
    infinite for a document without words. `sentence_log10(tokens)`: log10 p(tokens </s> | <s>)."""
    total, count = 0.0, 0
    for tokens in sentences(text):
        total += sentence_log10(tokens)
        count += len(tokens) + 1
    return 10.0 ** (-total / count) if count else math.inf


class KenLMScorer:
    """An ARPA file scored by KenLM (kenlm-ex's prebuilt wheel): NGramModel.perplexity's values, about 40x faster
    (2,600 against 109,000 paragraphs a second here)."""

    def __init__(self, path: str | Path):
        import kenlm

        config = kenlm.Config()
        config.show_progress = False  # its loading bar, printed to stderr from C++ between the preparation's lines
        self.model = kenlm.Model(str(path), config)

    def perplexity(self, text: str) -> float:
        return document_perplexity(lambda tokens: self.model.score(" ".join(tokens), bos=True, eos=True), text)


def _discount(adjusted: Counter) -> float:
    """Ney's D = n1 / (n1 + 2 n2) over an order's adjusted counts (0.5 where it is undefined)."""
    n1, n2 = sum(c == 1 for c in adjusted.values()), sum(c == 2 for c in adjusted.values())
    return n1 / (n1 + 2 * n2) if n1 and n2 else 0.5


def fit_kneser_ney(texts: Iterable[str], order: int = 3) -> NGramModel:
    """Interpolated Kneser-Ney over the texts' sentences (`sentences`). The highest order counts n-grams, lower
    orders count the distinct words seen before them (continuation counts), except n-grams that open a sentence,
    which have nothing before them and keep their counts; the unigrams are interpolated with a uniform
    distribution over the vocabulary and <unk>."""
    counts: list[Counter] = [Counter() for _ in range(order + 1)]
    for text in texts:
        for tokens in sentences(text):
            padded = [BOS] + tokens + [EOS]
            for n in range(1, order + 1):
                for i in range(len(padded) - n + 1):
                    counts[n][tuple(padded[i : i + n])] += 1
    adjusted: list[Counter] = [Counter() for _ in range(order + 1)]
    adjusted[order] = counts[order]
    for n in range(1, order):
        adjusted[n] = Counter({gram: c for gram, c in counts[n].items() if gram[0] == BOS})
        for gram in counts[n + 1]:  # each distinct word before gram[1:] (which never opens with <s>) counts once
            adjusted[n][gram[1:]] += 1
    adjusted[1].pop((BOS,), None)
    logprob: dict[tuple[str, ...], float] = {}
    backoff: dict[tuple[str, ...], float] = {}
    vocabulary = len(adjusted[1]) + 1  # and <unk>
    lower: dict[tuple[str, ...], float] = {}  # the previous order's probabilities
    for n in range(1, order + 1):
        discount = _discount(adjusted[n])
        totals, types = Counter(), Counter()  # per context: its words' adjusted counts, and how many words
        for gram, c in adjusted[n].items():
            totals[gram[:-1]] += c
            types[gram[:-1]] += 1
        gamma = {h: discount * types[h] / totals[h] for h in totals}
        probabilities = {}
        for gram, c in adjusted[n].items():
            history = gram[:-1]
            below = lower[gram[1:]] if n > 1 else 1.0 / vocabulary
            probabilities[gram] = max(c - discount, 0.0) / totals[history] + gamma[history] * below
        if n == 1:
            probabilities[(UNK,)] = gamma[()] / vocabulary
        if n > 1:  # the unigrams' weight goes to the uniform distribution, not to a back-off
            backoff.update({history: math.log10(weight) for history, weight in gamma.items()})
        logprob.update({gram: math.log10(p) for gram, p in probabilities.items()})
        lower = probabilities
    logprob[(BOS,)] = NEVER
    return NGramModel(order, logprob, backoff)
