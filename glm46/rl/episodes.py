"""Multi-turn episodes with tools, as GLM-4.5's agentic RL runs them (arXiv:2508.06471, section 3.2; slime's
multi-turn rollouts): the model writes a turn until one of GLM's stop tokens; a turn that ends in a tool call
(`<|observation|>`) is parsed in GLM's format (glm46.data.chat.parse_tool_calls), each call is served by the
episode's tools (glm46.data.tools), their results are appended as GLM-4.6's template writes them
(`\\n<tool_response>\\n...\\n</tool_response>` for each, then `<|assistant|>`), and the model goes on.

An episode ends with its reward when a turn ends otherwise (<|endoftext|>, <|user|>): the reward function scores
that last turn. It ends with reward 0, never an error, when a turn's tool call does not parse (GLM-4.5's format
penalty halts the trajectory), when it runs out of turns, or of tokens. A call that parses but that the tool cannot
serve returns the tool's error text, and the episode goes on.

Only the model's own tokens are trained: `model_mask` marks them (the stop token that ends each of its turns
included); the tool results and the `<|assistant|>` appended after them are context, never in the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from glm46.data.chat import ROLE_TOKENS, STOP_TOKENS, parse_tool_calls, tool_responses
from glm46.data.tokenizer import GLMTokenizer
from glm46.data.tools import ToolEnvironment
from glm46.modules.loss import IGNORE_INDEX

ENDINGS = ("answered", "unparsed_call", "out_of_turns", "out_of_tokens")
# generate(contexts, max_new_tokens, active) -> for each active episode (the episodes' indices; `contexts` are theirs,
# or one throwaway context when none is active), the turn it writes after its context (ids, cut after its first stop
# token) and the sampler's log-prob of each of those tokens (None when it has none).
TurnGenerator = Callable[[list[list[int]], int, list[int]], list[tuple[list[int], list[float] | None]]]


@dataclass
class Episode:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # everything after the prompt: the model's turns and tool results
    model_mask: list[int] = field(default_factory=list)  # 1 on the model's own tokens
    logprobs: list[float] = field(default_factory=list)  # the sampler's, 0 on tool tokens
    turns: int = 0
    tool_calls: int = 0
    reward: float = 0.0
    ended: str = ""  # one of ENDINGS once the episode has ended

    @property
    def done(self) -> bool:
        return bool(self.ended)

    def append(self, tokens: list[int], model: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.model_mask += [int(model)] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


def alone(budget: int, done: bool) -> tuple[int, bool]:
    """run_episodes' `agree` in one process: its own budget, and whether its own episodes are all done."""
    return budget, done


def run_episodes(
    prompts: list[list[int]],
    records: list[Mapping],
    generate: TurnGenerator,
    tokenizer: GLMTokenizer,
    reward: Callable[[Mapping, str], float],
    environments: list[ToolEnvironment],
    max_turns: int,
    max_tokens: int,
    agree: Callable[[int, bool], tuple[int, bool]] = alone,
    turn_tokens: int | None = None,
) -> list[Episode]:
    """Every prompt (its ids, ending at `<|assistant|>`; `records[i]` for the reward, `environments[i]` its tools)
    played out, all episodes a turn at a time. `max_tokens` bounds what follows each prompt (the model's tokens and
    the tool results). agree(this rank's turn budget, whether its episodes are all done) -> (the largest budget, whether
    every rank's are): ranks whose forwards are collective generate every turn in step, a rank whose episodes have
    ended writing a throwaway turn (`active` empty) until the others' have too. `turn_tokens` bounds each turn too (a
    turn that reaches it without a stop token ends the episode, out of tokens)."""
    episodes = [Episode(list(prompt)) for prompt in prompts]
    stops = {tokenizer.token_id(token) for token in STOP_TOKENS}
    observation = tokenizer.token_id(ROLE_TOKENS["tool"])
    while True:
        active = [i for i, episode in enumerate(episodes) if not episode.done]
        budget = max((max_tokens - len(episodes[i].tokens) for i in active), default=1)
        budget = min(budget, turn_tokens or budget)
        budget, all_done = agree(budget, not active)
        if all_done:
            return episodes
        contexts = [episodes[i].prompt + episodes[i].tokens for i in active] or [episodes[0].prompt]
        turns = generate(contexts, budget, active)
        for i, (turn, logprobs) in zip(active, turns):
            episode = episodes[i]
            room = max_tokens - len(episode.tokens)
            turn, logprobs = turn[:room], None if logprobs is None else logprobs[:room]
            episode.append(turn, model=True, logprobs=logprobs)
            episode.turns += 1
            if not turn or turn[-1] not in stops:
                episode.ended = "out_of_tokens"
            elif turn[-1] != observation:
                episode.ended, episode.reward = "answered", reward(records[i], tokenizer.decode(turn))
            else:
                _serve_calls(episode, tokenizer.decode(turn), environments[i], tokenizer, max_turns, max_tokens)


def _serve_calls(
    episode: Episode, turn: str, environment: ToolEnvironment, tokenizer: GLMTokenizer, max_turns: int, max_tokens: int
) -> None:
    try:
        calls = parse_tool_calls(turn, environment.schemas)
    except ValueError:
        calls = []
    if not calls:  # ended at <|observation|> without a call that parses: the format penalty, reward 0
        episode.ended = "unparsed_call"
        return
    if episode.turns >= max_turns:
        episode.ended = "out_of_turns"
        return
    episode.tool_calls += len(calls)
    # what follows the turn's <|observation|>: the results as GLM-4.6's template writes them, then the next turn
    results = tokenizer.encode(tool_responses([environment.step(call) for call in calls]) + ROLE_TOKENS["assistant"])
    if len(episode.tokens) + len(results) >= max_tokens:
        episode.ended = "out_of_tokens"
        return
    episode.append(results, model=False)


def episode_rows(
    episodes: list[Episode], pad_id: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[prompt | everything after it | padding] rows, right-padded: (input_ids [N, T], targets [N, T] holding each
    model token at the position before it and IGNORE_INDEX elsewhere, mask [N, T] 1 on those targets, the sampler's
    log-probs [N, T] at the same positions)."""
    width = max(len(e.prompt) + len(e.tokens) for e in episodes)
    input_ids = torch.full((len(episodes), width), pad_id, dtype=torch.long)
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    logprobs = torch.zeros(len(episodes), width)
    for row, episode in enumerate(episodes):
        p, n = len(episode.prompt), len(episode.tokens)
        input_ids[row, : p + n] = torch.tensor(episode.prompt + episode.tokens)
        model = torch.tensor(episode.model_mask, dtype=torch.bool)
        tokens = torch.tensor(episode.tokens, dtype=torch.long)
        targets[row, p - 1 : p + n - 1] = torch.where(model, tokens, IGNORE_INDEX)  # position t predicts t + 1
        logprobs[row, p - 1 : p + n - 1] = torch.tensor(episode.logprobs) * model
    mask = (targets != IGNORE_INDEX).float()
    return input_ids.to(device), targets.to(device), mask.to(device), logprobs.to(device)
