"""GLM-4.5's rejection filters (arXiv:2508.06471, section 3.1): what a sampled candidate must pass before a model is
trained on it. Each filter is a small function of one candidate; `rejection_reason` applies them in the order of
REASONS and names the first that fails:

- `repetitive`: the model's own text repeats itself: a line that recurs (`max_repeated_lines`), or one word n-gram
  covering more than `max_top_ngram_fraction` of its characters (a degenerate loop);
- `too_short`: fewer than `min_reply_tokens` tokens of the model's own;
- `truncated`: it ran out of tokens before a stop token;
- `broken_tool_protocol`: a tool call that does not parse, a call after the last allowed turn, a call to a tool
  the prompt does not offer or that the tool refuses (its result is an error);
- `malformed`: the conversation is not in GLM-4.6's chat format (glm46.data.chat_parse cannot read it back), or a
  verifiable prompt's final turn has no `Answer: <integer>` line;
- `wrong_answer`: a verifiable prompt's answer is wrong (glm46.rl.rewards.verify);
- `low_reward`: with a reward model, its normalised score is below `min_reward`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from glm46.rl.episodes import Episode
from glm46.rl.rewards import extract_answer

_WORD = re.compile(r"\S+")
TOOL_ERROR = "error: "  # how glm46.data.tools.ToolEnvironment answers a call it cannot serve


@dataclass
class FilterSettings:
    """The thresholds of the filters (`sample.filters`; conf/sample/default.yaml)."""

    max_repeated_lines: int = 2  # a non-empty line of the model's may occur at most this many times
    ngram: int = 3  # the word n-gram whose coverage is measured
    max_top_ngram_fraction: float = 0.3  # of the model's characters covered by its most frequent n-gram
    min_reply_tokens: int = 4
    min_reward: float | None = None  # the reward model's normalised score; None: no threshold


@dataclass
class Candidate:
    """One sampled continuation of a prompt, scored."""

    prompt: int  # the prompt's index
    number: int  # its number among the prompt's candidates (its seed)
    episode: Episode
    text: str  # the model's own text: its turns, without the tool results between them
    final: str  # the last turn's text
    messages: list[dict] | None  # the whole conversation read back in the messages format; None: it does not read
    answer: int | None  # the prompt's reference answer; None: an open prompt
    reward: float = 0.0  # the verifier's (1: right answer)
    score: float | None = None  # the reward model's normalised score
    tool_errors: int = 0  # tool results that are errors
    reason: str | None = None  # the first filter it failed; None: kept


def repetitive(candidate: Candidate, settings: FilterSettings) -> bool:
    lines = Counter(line.strip() for line in candidate.text.splitlines() if line.strip())
    if lines and max(lines.values()) > settings.max_repeated_lines:
        return True
    words = _WORD.findall(candidate.text)
    ngrams = Counter(zip(*(words[k:] for k in range(settings.ngram))))
    if not ngrams:
        return False
    top, count = ngrams.most_common(1)[0]
    covered = count * sum(map(len, top))
    return count > 1 and covered / max(len(candidate.text), 1) > settings.max_top_ngram_fraction


def too_short(candidate: Candidate, settings: FilterSettings) -> bool:
    return sum(candidate.episode.model_mask) < settings.min_reply_tokens


def truncated(candidate: Candidate, settings: FilterSettings) -> bool:
    return candidate.episode.ended == "out_of_tokens"


def broken_tool_protocol(candidate: Candidate, settings: FilterSettings) -> bool:
    return candidate.episode.ended in ("unparsed_call", "out_of_turns") or candidate.tool_errors > 0


def malformed(candidate: Candidate, settings: FilterSettings) -> bool:
    return candidate.messages is None or (candidate.answer is not None and extract_answer(candidate.final) is None)


def wrong_answer(candidate: Candidate, settings: FilterSettings) -> bool:
    return candidate.answer is not None and candidate.reward < 1


def low_reward(candidate: Candidate, settings: FilterSettings) -> bool:
    return settings.min_reward is not None and candidate.score is not None and candidate.score < settings.min_reward


FILTERS: dict[str, Callable[[Candidate, FilterSettings], bool]] = {
    "repetitive": repetitive,
    "too_short": too_short,
    "truncated": truncated,
    "broken_tool_protocol": broken_tool_protocol,
    "malformed": malformed,
    "wrong_answer": wrong_answer,
    "low_reward": low_reward,
}
REASONS = tuple(FILTERS)


def rejection_reason(candidate: Candidate, settings: FilterSettings) -> str | None:
    """The first filter the candidate fails, in the order of REASONS; None: it is kept."""
    return next((reason for reason, fails in FILTERS.items() if fails(candidate, settings)), None)


def best(candidates: list[Candidate]) -> Candidate | None:
    """The kept candidate with the highest verifier reward, then reward-model score; the first drawn among equals."""
    kept = [c for c in candidates if c.reason is None]
    return max(kept, key=lambda c: (c.reward, c.score if c.score is not None else 0.0, -c.number), default=None)
