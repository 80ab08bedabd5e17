"""Where the turns of multi-turn episodes (glm46.rl.episodes) are sampled: the policy's own KV-cache `generate`, or the
vLLM rollout engine. Both are TurnGenerators: (contexts, max_new_tokens, active episodes) -> each active episode's
turn, cut after its first stop token, with the sampler's log-probs (the engine's; none from `generate`). `module` is
the GRPO module (glm46.rl.grpo_module) whose policy, stop and pad ids, engine and rank stepping they use."""

from __future__ import annotations

import torch

from glm46.lit.module import GLM46LitModule

from .engine import from_first_rank, to_first_rank


def cut_at_stop(tokens: list[int], stop_ids: list[int]) -> int:
    """The length of a turn: up to and including its first stop token (all of it without one)."""
    return next((k + 1 for k, token in enumerate(tokens) if token in stop_ids), len(tokens))


class ModelTurns:
    """Turns from the policy's `generate`, the contexts left-padded into one batch. Each episode samples with its own
    generator (glm46.rl.grpo_module.GRPOLitModule.generators), the same one every turn, so that an episode draws the
    same tokens whatever rank or batch plays it, and again after a resume."""

    def __init__(self, module: GLM46LitModule, generators: list[torch.Generator], temperature: float):
        self.module, self.generators, self.temperature = module, generators, temperature

    @torch.no_grad()
    def __call__(self, contexts: list[list[int]], max_new_tokens: int, active: list[int]) -> list:
        module = self.module
        longest = max(map(len, contexts))
        ids = torch.full((len(contexts), longest), module.pad_id, dtype=torch.long, device=module.device)
        mask = torch.zeros_like(ids)
        for row, context in enumerate(contexts):
            ids[row, longest - len(context) :] = torch.tensor(context)
            mask[row, longest - len(context) :] = 1
        generators = [self.generators[i] for i in active] or [torch.Generator(module.device).manual_seed(0)]
        out = module.model.generate(
            ids,
            max_new_tokens,
            self.temperature,
            eos_token_id=module.stop_ids,
            generator=generators,
            attention_mask=mask,
            all_finished=module.all_finished,
        )
        turns = out[:, longest:].tolist()
        return [(turn[: cut_at_stop(turn, module.stop_ids)], None) for turn in turns[: len(active)]]


class EngineTurns:
    """Turns from the vLLM engine: the first rank sends every rank's contexts in one request, each episode's k-th turn
    sampled with the seed (its seed, k); the engine returns each sampled token's log-prob."""

    def __init__(self, module: GLM46LitModule, seeds: list[int], temperature: float):
        self.module, self.seeds, self.temperature = module, seeds, temperature
        self.turns = [0] * len(seeds)

    def __call__(self, contexts: list[list[int]], max_new_tokens: int, active: list[int]) -> list:
        module = self.module
        seeds = [hash((self.seeds[i], self.turns[i])) % 2**63 for i in active]
        for i in active:
            self.turns[i] += 1
        requests = to_first_rank((contexts[: len(active)], seeds))

        def generate():
            prompts = [p for mine, _ in requests for p in mine]
            answer = (
                module.engine.generate(
                    prompts,
                    [s for _, mine in requests for s in mine],
                    self.temperature,
                    max_new_tokens,
                    module.stop_ids,
                )
                if prompts
                else {"completions": [], "logprobs": []}
            )
            pairs, start = [], 0
            for mine, _ in requests:
                pairs.append(list(zip(answer["completions"][start : start + len(mine)], answer["logprobs"][start:])))
                start += len(mine)
            return pairs

        turns = from_first_rank(generate)
        return [(turn[:n], logprobs[:n]) for turn, logprobs in turns for n in [cut_at_stop(turn, module.stop_ids)]]
