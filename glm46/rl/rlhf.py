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

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from hydra.utils import get_method

from glm46.checkpoint import find_weights
from glm46.data.tokenizer import check_same_tokenizer
from glm46.errors import ConfigError
from glm46.rl.reward_export import INFO_FILE, RewardModel, load_reward_model
from glm46.sandbox import KINDS


@dataclass
class RewardSettings:
    """How an RL phase scores a completion (`phase.reward`): its verifier, and a reward model when `model` is set."""

    model: Optional[str] = None  # a reward model's run directory or export (module=reward_model); None: the verifier
    verifier_weight: float = 1.0
    model_weight: float = 1.0
    sandbox: str = "bubblewrap"  # where code prompts' programs run (glm46.rl.code_reward): bubblewrap, or none
    # `module.function(prompt text, completion text) -> float`: a rule the policy is not trained on, logged beside the
    # rewards (rl/monitor, val/monitor) to see whether it over-optimises the reward model; None: none
    monitor: Optional[str] = None

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
        if self.sandbox not in KINDS:
            raise ConfigError(f"phase.reward.sandbox={self.sandbox!r}: expected one of {list(KINDS)}")
        if self.monitor is not None:
            try:
                get_method(self.monitor)
            except Exception as error:
                raise ConfigError(f"phase.reward.monitor={self.monitor}: not a function ({error})") from None


def check_reward_model(settings: RewardSettings, tokenizer_file: Path, tokenizer_key: str) -> None:
    """phase.reward.model is a reward model whose tokenizer is the policy's (`tokenizer_file`, named by
    `tokenizer_key`): ConfigError naming both otherwise. What does not exist yet (a reward model an earlier stage
    of a curriculum trains, a dataset the run prepares first) is checked when the reward model is loaded."""
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


def monitor_scores(monitor: Callable[[str, str], float], tokenizer, input_ids: torch.Tensor, mask: torch.Tensor):
    """monitor(prompt text, completion text) of each rollout row [N]: the prompt before its first target, the
    completion up to its last (a multi-turn episode's tool results included)."""
    starts = mask.float().argmax(dim=1) + 1  # the first completion token: the position after the first target's
    ends = row_lengths(mask)
    scores = []
    for ids, start, end in zip(input_ids.tolist(), starts.tolist(), ends.tolist()):
        scores.append(monitor(tokenizer.decode(ids[:start]), tokenizer.decode(ids[start:end])))
    return torch.tensor(scores, dtype=torch.float32)


def row_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Each rollout row's length [N] from its target mask [N, T]: its last target's position + 2 (the position
    before a token holds it as its target)."""
    positions = torch.arange(2, mask.shape[1] + 2, device=mask.device)
    return (mask.bool() * positions).amax(dim=1)
