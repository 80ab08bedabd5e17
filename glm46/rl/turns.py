"""Where the turns of multi-turn episodes (glm46.rl.episodes) are sampled: a model's own KV-cache `generate` (the policy
in RL, the evaluated weights in the tool task of glm46.eval.harness), or the vLLM rollout engine. Both are
TurnGenerators: (contexts, max_new_tokens, active episodes) -> each active episode's turn, cut after its first stop
token, with the sampler's log-probs (the engine's; none from `generate`)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from .engine import from_first_rank, to_first_rank

if TYPE_CHECKING:
    from glm46.modules import GLM46ForCausalLM


def completion_seed(seed: int, index: int, number: int) -> int:
    """The sampling seed of completion `number` of the prompt with global index `index`: the same whichever rank,
    batch, layout or task samples it, and again after a resume."""
    return hash((seed, index, number)) % 2**63


def left_padded(contexts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists of different lengths -> left-padded ids and attention mask [N, longest], as `generate` takes them."""
    longest = max(map(len, contexts))
    ids = torch.full((len(contexts), longest), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, context in enumerate(contexts):
        ids[row, longest - len(context) :] = torch.tensor(context)
        mask[row, longest - len(context) :] = 1
    return ids, mask


def cut_at_stop(tokens: list[int], stop_ids: list[int]) -> int:
    """The length of a turn: up to and including its first stop token (all of it without one)."""
    return next((k + 1 for k, token in enumerate(tokens) if token in stop_ids), len(tokens))


class ModelTurns:
    """Turns from a model's `generate`, the contexts left-padded into one batch: greedy at temperature 0, else each
    episode samples with its own generator (glm46.rl.rollout_worker.RolloutWorker.generators), the same one every turn,
    so that an episode draws the same tokens whatever rank or batch plays it, and again after a resume.
    all_finished: generate's, for a model sharded over ranks."""

    def __init__(
        self,
        model: GLM46ForCausalLM,
        stop_ids: list[int],
        pad_id: int,
        device: torch.device,
        temperature: float = 0.0,
        generators: list[torch.Generator] | None = None,
        all_finished: Callable[[bool], bool] | None = None,
    ):
        self.model, self.stop_ids, self.pad_id, self.device = model, stop_ids, pad_id, device
        self.temperature, self.generators, self.all_finished = temperature, generators, all_finished

    @torch.no_grad()
    def __call__(self, contexts: list[list[int]], max_new_tokens: int, active: list[int]) -> list:
        ids, mask = left_padded(contexts, self.pad_id, self.device)
        generators = None
        if self.generators is not None:
            generators = [self.generators[i] for i in active] or [torch.Generator(self.device).manual_seed(0)]
        out = self.model.generate(
            ids,
            max_new_tokens,
            self.temperature,
            eos_token_id=self.stop_ids,
            generator=generators,
            attention_mask=mask,
            all_finished=self.all_finished,
        )
        turns = out[:, ids.shape[1] :].tolist()
        return [(turn[: cut_at_stop(turn, self.stop_ids)], None) for turn in turns[: len(active)]]


class EngineTurns:
    """Turns from the vLLM engine: the first rank sends every rank's contexts in one request. An episode's first turn
    is sampled with its seed, its k-th after that with the seed (its seed, k); the engine returns each sampled
    token's log-prob."""

    def __init__(self, worker, seeds: list[int], temperature: float):
        """worker: the glm46.rl.rollout_worker.RolloutWorker whose engine samples."""
        self.worker, self.seeds, self.temperature = worker, seeds, temperature
        self.turns = [0] * len(seeds)

    def __call__(self, contexts: list[list[int]], max_new_tokens: int, active: list[int]) -> list:
        worker = self.worker
        seeds = [self.seeds[i] if not self.turns[i] else hash((self.seeds[i], self.turns[i])) % 2**63 for i in active]
        for i in active:
            self.turns[i] += 1
        requests = to_first_rank((contexts[: len(active)], seeds))

        def generate():
            prompts = [context for mine, _ in requests for context in mine]
            answer = {"completions": [], "logprobs": []}
            if prompts:
                seeds = [seed for _, mine in requests for seed in mine]
                answer = worker.engine.generate(prompts, seeds, self.temperature, max_new_tokens, worker.stop_ids)
            starts = list(accumulate((len(mine) for mine, _ in requests), initial=0))
            return [list(zip(answer["completions"][a:b], answer["logprobs"][a:b])) for a, b in zip(starts, starts[1:])]

        turns = from_first_rank(generate)
        return [(turn[:n], logprobs[:n]) for turn, logprobs in turns for n in [cut_at_stop(turn, worker.stop_ids)]]
