"""Prompt batches for RL on verifiable answers (the embedded `rl` domain, or any chat documents that end
with a reference assistant reply): each sample is the conversation's ids up to and including the
`<|assistant|>` that opens the reply to its last user turn (where the policy starts; a reply with tool calls
goes on after their results), right-padded to seq_len, with its length, the reference answer (the integer of
the reference's last turn, which glm46.rl.rewards.verify checks completions against), a code prompt's tests (the
lines of the reference's ```tests block, glm46.rl.code_reward, as their ids; a code prompt's answer is 0 and unread),
whether the prompt lists tools (GLM's tools block: the episode may call them, glm46.rl.episodes) and its global sample
index (which seeds its completions' sampling, so that a prompt draws the same completions on any rank of any layout).

    batch = {"prompt_ids": [B, seq_len], "prompt_length": [B], "answer": [B], "tests_ids": [B, seq_len],
             "tests_length": [B], "tools": [B], "index": [B]}
    prompt = batch["prompt_ids"][i, : batch["prompt_length"][i]]        # ends with <|assistant|>
    reward = verify({"answer": batch["answer"][i]}, tokenizer.decode(completion))

Sampling, the rank split, the held-out prompts (validation) and the resumable position are
ShardDataModule's; the position counts prompts over the data-parallel ranks, as glm46.rl.grpo_module.GRPOLitModule
(the RL step that consumes these batches) counts them in `prompts_seen`.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from glm46.data.chat import ChatTokens, reply_span, reply_starts
from glm46.data.tokenizer import GLMTokenizer
from glm46.data.windows import MixtureWindows
from glm46.lit.shard_data import ShardDataModule
from glm46.rl.code_reward import extract_tests
from glm46.rl.rewards import extract_answer


class Prompts(MixtureWindows):
    """MixtureWindows whose bins are single whole documents, sampled as prompt records."""

    def __init__(self, *args, tokenizer: GLMTokenizer, **kwargs):
        super().__init__(*args, **kwargs)
        self.tokenizer, self.chat = tokenizer, ChatTokens(tokenizer)

    def sample(self, domain: int, item: int) -> dict[str, np.ndarray]:
        ((start, length),) = self.bins[domain][item]
        document = np.asarray(self.streams[domain][start : start + length], dtype=np.int64)
        end, last = reply_span(document, self.chat)
        reply = self.tokenizer.decode(document[last:-1].tolist())  # the reference's last turn, without <|endoftext|>
        answer, tests = extract_answer(reply), extract_tests(reply)
        if answer is None and not tests:
            raise ValueError(
                f"the reference reply {reply!r} has neither a final 'Answer: <integer>' (glm46.rl.rewards) nor a "
                "```tests block (glm46.rl.code_reward)"
            )
        prompt, tests_ids = np.full((2, self.seq_len), self.pad_id, dtype=np.int64)
        prompt[:end] = document[:end]
        encoded = self.tokenizer.encode("\n".join(tests)) if tests else []
        if len(encoded) > self.seq_len:
            raise ValueError(f"the tests of {reply!r} are {len(encoded)} tokens, more than seq_len={self.seq_len}")
        tests_ids[: len(encoded)] = encoded
        tools = np.bool_(self.chat.tool_call is not None and (document[:end] == self.chat.tool_call).any())
        return {
            "prompt_ids": prompt,
            "prompt_length": np.int64(end),
            "answer": np.int64(0 if tests else answer),
            "tests_ids": tests_ids,
            "tests_length": np.int64(len(encoded)),
            "tools": tools,
        }

    def batch(self, number: int) -> dict[str, torch.Tensor]:
        return super().batch(number) | {"index": torch.from_numpy(self.indices(number))}


class PromptDataModule(ShardDataModule):
    """seq_len is the longest prompt served: documents with longer prompts (or no assistant turn) are left out."""

    def __init__(
        self,
        path: str,
        seq_len: int,
        batch_size: int,
        mixture: dict[str, float],
        seed: int = 0,
        val_fraction: float = 0.02,
        val_windows: int = 64,
        phase: str = "rl",
        num_workers: int = 0,
    ):
        super().__init__(path, seq_len, batch_size, mixture, seed, val_fraction, val_windows, phase, "pad", num_workers)
        self.tokenizer = GLMTokenizer.from_file(self.root / "tokenizer.json")
        self.dataset = partial(Prompts, tokenizer=self.tokenizer)

    def document_bins(self, tokens: np.ndarray, offsets: np.ndarray) -> list[list[tuple[int, int]]]:
        """Documents whose prompt (up to the <|assistant|> that opens the reply to the last user turn) fits
        seq_len, one per bin."""
        starts = reply_starts(tokens, ChatTokens(self.tokenizer))
        document = np.searchsorted(offsets, starts - 1, side="right") - 1  # the document of each reply
        end = np.full(len(offsets) - 1, -1)
        end[document] = starts  # the last one of each document wins
        fits = (end >= 0) & (end - offsets[:-1] <= self.seq_len)
        return [[(int(offsets[d]), int(offsets[d + 1] - offsets[d]))] for d in np.flatnonzero(fits)]

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        for domain, bins in self.bins.items():
            if not bins:
                raise ValueError(
                    f"domain {domain!r} has no chat document with a prompt of at most "
                    f"seq_len={self.seq_len} tokens ending in <|assistant|>"
                )

    def samples_consumed(self) -> int:
        """Prompts trained on over all data-parallel ranks (tensor-parallel ranks share theirs)."""
        return getattr(self.trainer.lightning_module, "prompts_seen", 0) if self.trainer else 0
