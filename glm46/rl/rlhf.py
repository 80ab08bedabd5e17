"""RLHF: an RL stage's reward as its verifier's mixed with a reward model's score (`phase.reward`), as GLM-4.5's general
RL scores open answers with a reward model beside rule rewards (arXiv:2508.06471, section 3.4):

    reward = verifier_weight * verify(answer, completion) + model_weight * (rm(conversation) - mean) / std

The reward model (glm46.rl.reward_model, its export read by glm46.rl.reward_export) scores each rollout row, the
prompt and the completion (a multi-turn episode with its tool results), in its own forward at the row's last
token, normalised by the mean and std of its held-out rewards recorded in its export. It is held whole on every
rank (a reward model as large as the policy would need a layout of its own, or a serving engine). Its tokenizer
must be the policy's: the same ids would otherwise be different text, and that is refused naming both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from glm46.checkpoint import find_weights
from glm46.errors import ConfigError
from glm46.rl.reward_export import INFO_FILE, RewardModel, load_reward_model


@dataclass
class RewardSettings:
    """How an RL phase scores a completion (`phase.reward`): its verifier, and a reward model when `model` is set."""

    model: Optional[str] = None  # a reward model's run directory or export (module=reward_model); None: the verifier
    verifier_weight: float = 1.0
    model_weight: float = 1.0

    def __post_init__(self):
        if self.verifier_weight < 0 or self.model_weight < 0:
            raise ConfigError(
                f"phase.reward.verifier_weight={self.verifier_weight} and phase.reward.model_weight="
                f"{self.model_weight} must be >= 0"
            )
        if self.model is None and self.verifier_weight == 0:
            raise ConfigError(
                "phase.reward.verifier_weight=0 and no phase.reward.model: nothing would score a completion"
            )


def check_reward_model(settings: RewardSettings, tokenizer_file: Path, tokenizer_key: str) -> None:
    """phase.reward.model is a reward model whose tokenizer is the policy's (`tokenizer_file`, named by
    `tokenizer_key`): ConfigError naming both otherwise. What does not exist yet (a reward model an earlier stage
    of a curriculum trains, a dataset the run prepares first) is checked when the reward model is loaded."""
    from glm46.config.export_checks import check_same_tokenizer

    if settings.model is None or not Path(settings.model).exists() or not tokenizer_file.is_file():
        return
    try:
        folder = find_weights(settings.model)
    except FileNotFoundError as error:
        raise ConfigError(f"phase.reward.model={settings.model}: {error}") from None
    if not (folder / INFO_FILE).is_file():
        raise ConfigError(
            f"phase.reward.model={settings.model}: {folder} holds no reward model ({INFO_FILE} is missing): train one "
            f"with module=reward_model"
        )
    check_same_tokenizer(("phase.reward.model", folder / "tokenizer.json"), (tokenizer_key, tokenizer_file))


class MixedReward:
    """The verifier's rewards mixed with a reward model's normalised scores, by the settings' weights."""

    def __init__(self, settings: RewardSettings, tokenizer_file: Path, device: torch.device):
        self.settings = settings
        self.model: RewardModel | None = None
        if settings.model is not None:
            check_reward_model(settings, tokenizer_file, "the policy's tokenizer")
            self.model = load_reward_model(settings.model, device)

    def to(self, device: torch.device) -> MixedReward:
        if self.model is not None:
            self.model.model.to(device)
            self.model.head = self.model.head.to(device)
        return self

    def __call__(
        self, verified: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the rewards [N], their parts) of rows [N, T] of `lengths` tokens whose verifier rewards are `verified`."""
        total = self.settings.verifier_weight * verified
        parts = {"verifier_reward": verified.float().mean()}
        if self.model is not None:
            scores = self.model.normalized(self.model.score(input_ids, lengths))
            total = total + self.settings.model_weight * scores
            parts["rm_reward"] = scores.mean()
        return total, parts
