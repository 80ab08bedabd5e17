"""The rollout batch an RL update trains on: sampled completions laid out as rows, group by group (the samples of one
prompt consecutive), with what the losses need of each row. glm46.rl.grpo_module fills it; PPO adds the critic's."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from glm46.modules.loss import IGNORE_INDEX


@dataclass
class Rollout:
    """Sampled completions laid out for training: row i is [prompt | completion | padding] at positions 0..T-1."""

    input_ids: torch.Tensor  # [N, T]
    targets: torch.Tensor  # [N, T] the next token at completion positions, IGNORE_INDEX elsewhere
    mask: torch.Tensor  # [N, T] 1 where targets holds a completion token
    advantages: torch.Tensor  # [N]
    old_logprobs: torch.Tensor | None = None  # [N, T] under the rollout policy (the updates after the first)
    engine_logprobs: torch.Tensor | None = None  # [N, T] the inference engine's, of the tokens it sampled
    old_values: torch.Tensor | None = None  # [N, T] the critic's at the rollout (PPO)
    returns: torch.Tensor | None = None  # [N, T] the critic's targets (PPO)
    rewards: torch.Tensor | None = None  # [N] each row's reward (what its advantage was estimated from)

    def select(self, rows: slice | torch.Tensor) -> Rollout:
        """The rows `rows` (a slice or indices) of every field."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Rollout(**{name: None if value is None else value[rows] for name, value in values.items()})

    def split(self, parts: int) -> list[Rollout]:
        """`parts` slices of whole prompt groups (the rows are laid out group by group)."""
        rows = self.input_ids.shape[0] // parts
        return [self.select(slice(i * rows, (i + 1) * rows)) for i in range(parts)]

    @staticmethod
    def concatenated(parts: list[Rollout], pad_id: int) -> Rollout:
        """The parts' rows one after another, each right-padded to the widest part (padding is never a target)."""
        width = max(part.input_ids.shape[1] for part in parts)
        padding = {"input_ids": pad_id, "targets": IGNORE_INDEX}  # the mask, log-probs and values: 0

        def column(name: str) -> torch.Tensor | None:
            values = [getattr(part, name) for part in parts]
            if any(value is None for value in values):
                return None
            if values[0].dim() == 1:
                return torch.cat(values)
            return torch.cat([F.pad(v, (0, width - v.shape[1]), value=padding.get(name, 0)) for v in values])

        return Rollout(**{f.name: column(f.name) for f in fields(Rollout)})
