"""The rollout side of RL, apart from the update (slime's rollout/train split): RolloutWorker turns a batch of prompts
into a Rollout (glm46.rl.rollout_batch) and the verifier's rewards, sampled by the policy's own KV-cache `generate`
or by a vLLM engine (glm46.rl.engine), as single completions or multi-turn episodes with tools
(glm46.rl.episodes). The learner (glm46.rl.grpo_module) mixes in a reward model, estimates advantages and updates.

Each completion's sampling is seeded by (seed, its prompt's global sample index, its number in the group), so a
resumed run draws the same completions as an uninterrupted one, and N data-parallel processes (each rolls out its
share of the prompts, whole groups) the same as one. Ranks generate in step (a sharded model's forwards are
collective): `all_finished` and `agree` settle, across ranks, when a batch is done.

With the engine, the first rank gathers every rank's prompts, the engine samples them (each completion with the same
seed as above) and returns each token's log-prob (EngineTurns); `push_weights` writes the policy as an HF directory
and loads it into the engine, which the first push starts.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from glm46.checkpoint.hf_write import save_hf
from glm46.data.chat import STOP_TOKENS, ChatTokens
from glm46.data.tokenizer import GLMTokenizer
from glm46.data.tools import ToolEnvironment
from glm46.modules import GLM46ForCausalLM
from glm46.modules.loss import IGNORE_INDEX
from glm46.peft.merge import merged_weights
from glm46.rl.engine import RolloutSettings, VLLMRolloutEngine, from_first_rank, world_size
from glm46.rl.episodes import ENDINGS, Episode, TurnGenerator, episode_rows, run_episodes
from glm46.rl.rollout_batch import Rollout
from glm46.rl.turns import EngineTurns, ModelTurns, completion_seed, left_padded


def unscored_as_nan(rewards: list[float | None], device: torch.device) -> torch.Tensor:
    """A verifier's rewards [N], NaN where it could not score (None)."""
    return torch.tensor([float("nan") if r is None else r for r in rewards], dtype=torch.float32, device=device)


class RolloutWorker:
    """Rollouts of the policy `model` (held, not owned: the learner trains it). `grpo` gives the sampling settings
    (samples_per_prompt, max_new_tokens, max_turns, max_turn_tokens: glm46.rl.grpo_settings.GRPOSettings), `rollout`
    where they are sampled; reward(record, completion text) is the verifier (None where it could not score);
    device() the rank's device."""

    def __init__(
        self,
        model: GLM46ForCausalLM,
        tokenizer: GLMTokenizer,
        grpo,
        rollout: RolloutSettings,
        reward: Callable[[Mapping, str], float | None],
        seed: int,
        device: Callable[[], torch.device],
    ):
        self.model, self.tokenizer, self.grpo, self.settings = model, tokenizer, grpo, rollout
        self.reward, self.seed, self._device = reward, seed, device
        self.stop_ids = [tokenizer.token_id(t) for t in STOP_TOKENS]
        self.pad_id = ChatTokens(tokenizer).eos
        self.engine: VLLMRolloutEngine | None = None  # on global rank 0, with engine=vllm
        self.engine_step = -1  # the global step whose weights the engine holds

    @property
    def device(self) -> torch.device:
        return self._device()

    @property
    def uses_engine(self) -> bool:
        return self.settings.engine == "vllm"

    # -- prompts and their records
    def prompts(self, batch: dict[str, torch.Tensor], samples: int) -> list[list[int]]:
        """Each prompt's ids, `samples` times in a row (rows group by group, prompt-major)."""
        lengths = batch["prompt_length"].tolist()
        return [batch["prompt_ids"][i, :n].tolist() for i, n in enumerate(lengths) for _ in range(samples)]

    def records(self, batch: dict[str, torch.Tensor], samples: int = 1) -> list[dict]:
        """Each prompt's record for the verifier, `samples` times in a row: {"answer": int, "tests": [a code
        prompt's tests] or []}."""
        tests = [
            self.tokenizer.decode(ids[:n]).split("\n") if n else []
            for ids, n in zip(batch["tests_ids"].tolist(), batch["tests_length"].tolist())
        ]
        records = [{"answer": a, "tests": t} for a, t in zip(batch["answer"].tolist(), tests)]
        return [record for record in records for _ in range(samples)]

    def sample_seeds(self, batch: dict[str, torch.Tensor], samples: int) -> list[int]:
        """One seed per completion, from (seed, the prompt's global sample index, the sample's number): a prompt draws
        the same completions whichever rank, batch or layout samples it, and again after a resume."""
        return [completion_seed(self.seed, index, j) for index in batch["index"].tolist() for j in range(samples)]

    def generators(self, batch: dict[str, torch.Tensor], samples: int) -> list[torch.Generator]:
        return [torch.Generator(self.device).manual_seed(seed) for seed in self.sample_seeds(batch, samples)]

    # -- ranks in step
    def all_finished(self, done: bool) -> bool:
        """Whether every rank's completions have ended: ranks generate in step, as a sharded model's forwards gather
        weights (FSDP2) or exchange tokens (EP) collectively."""
        if world_size() == 1:
            return done
        flag = torch.tensor(float(done), device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag)

    def agree(self, budget: int, done: bool) -> tuple[int, bool]:
        """run_episodes' step across ranks: the largest turn budget, and whether every rank's episodes have ended."""
        if world_size() == 1:
            return budget, done
        values = torch.tensor([budget, int(not done)], device=self.device)
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
        return int(values[0]), not bool(values[1])

    # -- single completions
    def completion_lengths(self, completions: torch.Tensor) -> torch.Tensor:
        """Tokens of each completion up to and including its first stop token [N]."""
        stops = torch.isin(completions, torch.tensor(self.stop_ids, device=completions.device))
        return torch.where(stops.any(1), stops.int().argmax(1) + 1, completions.shape[1])

    @torch.no_grad()
    def sample(
        self,
        batch: dict[str, torch.Tensor],
        samples: int,
        temperature: float,
        generator: torch.Generator | list[torch.Generator] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Completions of every prompt `samples` times -> (prompt lengths [N], completions [N, M], lengths [N]),
        rows group by group (prompt-major)."""
        ids, mask = left_padded(self.prompts(batch, samples), self.pad_id, self.device)
        out = self.model.generate(
            ids,
            self.grpo.max_new_tokens,
            temperature,
            eos_token_id=self.stop_ids,
            generator=generator,
            attention_mask=mask,
            all_finished=self.all_finished,
        )
        completions = out[:, ids.shape[1] :]
        return (
            batch["prompt_length"].to(self.device).repeat_interleave(samples),
            completions,
            self.completion_lengths(completions),
        )

    def engine_sample(
        self, batch: dict[str, torch.Tensor], samples: int, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`sample`'s (prompt lengths, completions, lengths) from the engine, with its log-probs of the completion
        tokens [N, M]: the first turn of each sample's episode (glm46.rl.turns.EngineTurns)."""
        rows = len(batch["prompt_ids"]) * samples
        turns = EngineTurns(self, self.sample_seeds(batch, samples), temperature)
        completions, logprobs = zip(*turns(self.prompts(batch, samples), self.grpo.max_new_tokens, list(range(rows))))
        width = max(map(len, completions))
        tokens = torch.full((len(completions), width), self.pad_id, dtype=torch.long)
        values = torch.zeros(len(completions), width)
        for i, (ids, lps) in enumerate(zip(completions, logprobs)):
            tokens[i, : len(ids)], values[i, : len(ids)] = torch.tensor(ids), torch.tensor(lps)
        tokens = tokens.to(self.device)
        prompt_lengths = batch["prompt_length"].to(self.device).repeat_interleave(samples)
        return prompt_lengths, tokens, self.completion_lengths(tokens), values.to(self.device)

    def rewards(self, completions: torch.Tensor, lengths: torch.Tensor, records: list[dict]) -> torch.Tensor:
        """The verifier's reward of each completion [N] (NaN where it could not score)."""
        texts = [self.tokenizer.decode(c[:n].tolist()) for c, n in zip(completions, lengths.tolist())]
        return unscored_as_nan([self.reward(r, t) for r, t in zip(records, texts)], self.device)

    def layout(
        self, batch: dict[str, torch.Tensor], prompt_lengths: torch.Tensor, completions: torch.Tensor, lengths
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[prompt | completion] rows right-padded (causal attention never lets a real token see the padding),
        the targets of the positions before each completion token, and their mask."""
        rows, width = len(completions), int((prompt_lengths + lengths).max())
        input_ids = torch.full((rows, width), self.pad_id, dtype=torch.long, device=self.device)
        targets = torch.full_like(input_ids, IGNORE_INDEX)
        samples = rows // len(batch["prompt_ids"])
        prompts = batch["prompt_ids"].to(self.device).repeat_interleave(samples, 0)
        for i, (p, n) in enumerate(zip(prompt_lengths.tolist(), lengths.tolist())):
            input_ids[i, :p] = prompts[i, :p]
            input_ids[i, p : p + n] = completions[i, :n]
            targets[i, p - 1 : p + n - 1] = completions[i, :n]  # position t predicts token t + 1
        return input_ids, targets, (targets != IGNORE_INDEX).float()

    def single_turns(self, batch: dict[str, torch.Tensor], temperature: float) -> tuple[Rollout, torch.Tensor]:
        """One completion per sample, scored as it ends: (the rollout without advantages, the rewards)."""
        samples = self.grpo.samples_per_prompt
        engine_logprobs = None
        if self.uses_engine:
            prompt_lengths, completions, lengths, engine_logprobs = self.engine_sample(batch, samples, temperature)
        else:
            generators = self.generators(batch, samples)
            prompt_lengths, completions, lengths = self.sample(batch, samples, temperature, generators)
        rewards = self.rewards(completions, lengths, self.records(batch, samples))
        rollout = Rollout(*self.layout(batch, prompt_lengths, completions, lengths), advantages=None)
        if engine_logprobs is not None:  # at the positions of their targets, as the trainer's log-probs
            rollout.engine_logprobs = torch.zeros_like(rollout.mask)
            for i, (p, n) in enumerate(zip(prompt_lengths.tolist(), lengths.tolist())):
                rollout.engine_logprobs[i, p - 1 : p + n - 1] = engine_logprobs[i, :n]
        return rollout, rewards

    # -- multi-turn episodes
    def model_turns(self, temperature: float, generators: list[torch.Generator] | None) -> ModelTurns:
        return ModelTurns(
            self.model, self.stop_ids, self.pad_id, self.device, temperature, generators, self.all_finished
        )

    def play(self, batch: dict[str, torch.Tensor], samples: int, turns: TurnGenerator) -> list[Episode]:
        """Every prompt's `samples` episodes: a prompt that lists tools may call them (the calculator)."""
        records = self.records(batch, samples)
        tools = batch["tools"].repeat_interleave(samples).tolist()
        environments = [ToolEnvironment() if offers else ToolEnvironment(tools=[]) for offers in tools]
        return run_episodes(
            self.prompts(batch, samples), records, turns, self.tokenizer, self.reward, environments,
            self.grpo.max_turns, self.grpo.max_new_tokens, agree=self.agree, turn_tokens=self.grpo.max_turn_tokens,
        )  # fmt: skip

    def episodes(self, batch: dict[str, torch.Tensor], temperature: float) -> tuple[Rollout, torch.Tensor, dict]:
        """Multi-turn episodes (max_turns > 1), their tool results context: only the model's tokens are trained
        (glm46.rl.episodes). Returns the rollout, the rewards and the episodes' statistics (turns, tool calls and
        how they ended, as shares)."""
        samples = self.grpo.samples_per_prompt
        if self.uses_engine:
            turns = EngineTurns(self, self.sample_seeds(batch, samples), temperature)
        else:
            turns = self.model_turns(temperature, self.generators(batch, samples))
        played = self.play(batch, samples, turns)
        input_ids, targets, mask, logprobs = episode_rows(played, self.pad_id, self.device)
        stats = {
            "turns": sum(e.turns for e in played) / len(played),
            "tool_calls": sum(e.tool_calls for e in played) / len(played),
            **{f"ended_{ending}": sum(e.ended == ending for e in played) / len(played) for ending in ENDINGS},
        }
        rollout = Rollout(input_ids, targets, mask, None, engine_logprobs=logprobs if self.uses_engine else None)
        return rollout, unscored_as_nan([e.reward for e in played], self.device), stats

    def collect(self, batch: dict[str, torch.Tensor], temperature: float) -> tuple[Rollout, torch.Tensor, dict]:
        """The batch's rollout at `temperature`: (the rollout without advantages, the verifier's rewards [N], the
        episodes' statistics, empty for single turns)."""
        if self.grpo.max_turns > 1:
            return self.episodes(batch, temperature)
        return (*self.single_turns(batch, temperature), {})

    def verified(self, batch: dict[str, torch.Tensor], temperature: float, generators) -> torch.Tensor:
        """One completion (or episode, tool calls served) per prompt at `temperature` from the policy's own generate,
        and the verifier's rewards: held-out accuracy (greedy with temperature 0 and no generators)."""
        if self.grpo.max_turns > 1:
            played = self.play(batch, 1, self.model_turns(temperature, generators))
            return unscored_as_nan([e.reward for e in played], self.device)
        _, completions, lengths = self.sample(batch, 1, temperature, generators)
        return self.rewards(completions, lengths, self.records(batch))

    # -- the engine's weights
    def push_weights(self, root: Path, step: int) -> float:
        """Write the policy as an HF directory (every rank: a sharded model is written slice by slice) and load it into
        the engine, which the first push starts; the previous directory is then removed. Returns the seconds."""
        directory = root / f"policy-step{step}"
        started = time.perf_counter()
        with merged_weights(self.model):  # adapters (peft=lora|dora) folded in for the engine, then back as they were
            save_hf(self.model, directory, tokenizer=self.tokenizer)
        world = world_size()

        def load():
            if self.engine is None:
                dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
                self.engine = VLLMRolloutEngine(self.settings, directory, root / "engine.log", dtype, seed=self.seed)
            else:
                self.engine.load_weights(directory)
            for previous in root.glob("policy-step*"):
                if previous != directory:
                    shutil.rmtree(previous, ignore_errors=True)
            return [None] * world

        from_first_rank(load)
        self.engine_step = step
        return time.perf_counter() - started

    def close(self, root: Path) -> None:
        """The engine ends, and the last weights pushed to it (the final export holds them) go."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            for pushed in root.glob("policy-step*"):
                shutil.rmtree(pushed, ignore_errors=True)
