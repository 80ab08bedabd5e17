"""Drawing the candidates of rejection sampling: each prompt's `n` continuations from a model, played as episodes
(glm46.rl.episodes: a prompt that offers tools may call them, and its calls are served), scored by the verifier and,
where one is given, a reward model, and judged by the filters (glm46.sampling.filters).

Candidate k of prompt i is sampled with its own generator seeded by (seed, i, k), as GRPO seeds its completions
(glm46.rl.turns.completion_seed), and prompts go to the model in fixed batches of `batch_size`: a batch draws the same
tokens whichever task samples it, so that any split of the batches over tasks writes what one process writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from glm46.data.chat import EOS, ROLE_TOKENS, STOP_TOKENS
from glm46.data.chat_parse import parse_chat
from glm46.data.tokenizer import GLMTokenizer
from glm46.data.tools import ToolEnvironment, environment
from glm46.modules import GLM46ForCausalLM
from glm46.rl.episodes import Episode, episode_rows, run_episodes
from glm46.rl.reward_export import RewardModel
from glm46.rl.rewards import verify
from glm46.rl.rlhf import row_lengths
from glm46.rl.turns import ModelTurns, completion_seed
from glm46.sampling.filters import TOOL_ERROR, Candidate, FilterSettings, rejection_reason
from glm46.sampling.prompt_records import SamplePrompt


@dataclass
class DrawSettings:
    """How candidates are drawn (`sample.*`; conf/sample/default.yaml)."""

    n: int = 8  # candidates per prompt
    temperature: float = 1.0
    max_new_tokens: int = 256  # everything after the prompt: the model's turns and the tool results
    max_turns: int = 2  # turns of a tool episode (a prompt without tools: one)
    max_turn_tokens: int | None = None  # each turn's bound too
    batch_size: int = 8  # prompts per batch (their n candidates decode together)


def tool_environment(prompt: SamplePrompt) -> ToolEnvironment:
    """The built-in tools (glm46.data.tools) that the prompt offers, by name; ValueError naming the prompt for a tool
    this framework cannot serve."""
    names = [(tool.get("function") or tool)["name"] for tool in prompt.tools or []]
    try:
        return environment(names)
    except ValueError as error:
        raise ValueError(f"prompt {prompt.id}: {error}") from None


def _verified(record: Mapping, text: str) -> float:
    return verify(record, text) if record["answer"] is not None else 0.0


def model_runs(episode: Episode, tokenizer: GLMTokenizer) -> list[str]:
    """The text of each of the model's turns (its runs of own tokens), the stop token that ends it left out."""
    runs, current = [], []
    for token, own in zip(episode.tokens, episode.model_mask):
        if own:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    stops = {tokenizer.token_id(token) for token in STOP_TOKENS}
    return [tokenizer.decode(run[:-1] if run[-1] in stops else run) for run in runs]


def candidate(prompt: SamplePrompt, number: int, episode: Episode, tokenizer: GLMTokenizer) -> Candidate:
    """The episode as a candidate: its texts, and its conversation read back (None when it does not read)."""
    turns = model_runs(episode, tokenizer)
    whole = tokenizer.decode(prompt.ids + episode.tokens)
    if episode.ended == "answered":
        whole = whole.removesuffix(EOS).removesuffix(ROLE_TOKENS["user"])
    try:
        messages, _ = parse_chat(whole)
    except ValueError:
        messages = None
    errors = sum(
        m["role"] == "tool" and str(m.get("content", "")).startswith(TOOL_ERROR) for m in messages or []
    )  # fmt: skip
    return Candidate(
        prompt=prompt.index, number=number, episode=episode, text="\n".join(turns), final=turns[-1] if turns else "",
        messages=messages, answer=prompt.answer, reward=episode.reward, tool_errors=errors,
    )  # fmt: skip


@torch.no_grad()
def draw(
    model: GLM46ForCausalLM,
    tokenizer: GLMTokenizer,
    prompts: list[SamplePrompt],
    settings: DrawSettings,
    filters: FilterSettings,
    seed: int,
    reward_model: RewardModel | None = None,
) -> list[list[Candidate]]:
    """Each prompt's candidates, judged (`reason` set on the dropped ones), in prompt and draw order."""
    device = next(model.parameters()).device
    rows = [(prompt, k) for prompt in prompts for k in range(settings.n)]
    generators = [torch.Generator(device).manual_seed(completion_seed(seed, p.index, k)) for p, k in rows]
    stop_ids = [tokenizer.token_id(token) for token in STOP_TOKENS]
    turns = ModelTurns(model, stop_ids, tokenizer.token_id(EOS), device, settings.temperature, generators)
    environments = {p.index: tool_environment(p) for p in prompts}
    episodes = run_episodes(
        [p.ids for p, _ in rows], [{"answer": p.answer} for p, _ in rows], turns, tokenizer, _verified,
        [environments[p.index] for p, _ in rows], settings.max_turns, settings.max_new_tokens,
        turn_tokens=settings.max_turn_tokens,
    )  # fmt: skip
    candidates = [candidate(p, k, e, tokenizer) for (p, k), e in zip(rows, episodes)]
    if reward_model is not None:  # each row read at its last token of the model's, as RLHF scores its rollouts
        input_ids, _, mask, _ = episode_rows(episodes, tokenizer.token_id(EOS), reward_model.head.device)
        scores = reward_model.normalized(reward_model.score(input_ids, row_lengths(mask)))
        for c, s in zip(candidates, scores.tolist()):
            c.score = s
    for c in candidates:
        c.reason = rejection_reason(c, filters)
    return [candidates[i * settings.n : (i + 1) * settings.n] for i in range(len(prompts))]
