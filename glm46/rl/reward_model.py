"""RewardModelLitModule: a reward model trained on preference pairs, as GLM-4.5's general RL scores open answers
(arXiv:2508.06471, section 3.4) and InstructGPT's RLHF trains its reward model (arXiv:2203.02155).

The GLM backbone (started from an SFT export, `init_from`) with a bias-free scalar head `score` [1, hidden], read
at the last token of the reply (the token that closes it: glm46.lit.preference_data), as transformers'
*ForSequenceClassification and TRL's RewardTrainer read theirs at the last token. The loss is Bradley-Terry's
(glm46.rl.preference_loss.bradley_terry_loss) with TRL's margin and centring options. The lm_head and the MTP layers
are not trained (frozen: the reward reads the final norm's output); they stay in the export as they were loaded.
The forward of both sides is glm46.rl.preference_module's.

Held-out pairs give `rm/accuracy` and `rm/margin`, and the mean and std of their rewards, which the export records
(`reward_model.json`) so that RL can normalise the rewards it reads. The export is an HF directory: the backbone
as glm46.checkpoint.save_hf writes it (a Glm4MoeForCausalLM that transformers loads), the head in
`reward_head.safetensors` beside it (glm46.rl.reward_export).

Under the mesh layouts (FSDP2, TP, EP) the head is a plain replicated weight: its gradient is averaged over the
data-parallel ranks in each backward, as FSDP averages the backbone's, so that N processes train as one.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torchmetrics import CatMetric, MeanMetric

from glm46.data.tokenizer import GLMTokenizer
from glm46.parallel.data_parallel import average_gradients_in_backward
from glm46.rl.preference_loss import bradley_terry_loss
from glm46.rl.preference_module import PreferenceLitModule
from glm46.rl.reward_export import save_reward_head


class RewardModelLitModule(PreferenceLitModule):
    def __init__(self, *args, margin: float = 0.0, center_coef: float | None = None, **kwargs):
        """The GLM46LitModule arguments, plus the Bradley-Terry options: `margin` (subtracted from every pair's
        reward difference inside the sigmoid) and `center_coef` (TRL's center_rewards_coefficient; None: off)."""
        super().__init__(*args, **kwargs)
        self.margin, self.center_coef = margin, center_coef
        self.score = nn.Linear(self.config.hidden_size, 1, bias=False)
        nn.init.zeros_(self.score.weight)  # every reward 0 at first (loss log 2), and the same on every layout
        self.val_accuracy, self.val_margin, self.val_rewards = MeanMetric(), MeanMetric(), CatMetric()
        self.reward_mean, self.reward_std = 0.0, 1.0  # of the held-out rewards, at the last validation

    def frozen_modules(self) -> list[nn.Module]:
        """The lm_head too: the reward reads the final norm's output."""
        return [*super().frozen_modules(), self.model.lm_head]

    def configure_model(self) -> None:
        super().configure_model()
        self.score.to(self.model.lm_head.weight.device)
        average_gradients_in_backward([self.score.weight], self.trainer.strategy)

    def rewards(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rewards [B] of the chosen and the rejected sides, in one forward of both."""
        hidden = self.pair_hidden_states(batch)
        last = self.both_sides(batch, "length") - 1
        scores = self.score(hidden[torch.arange(len(hidden), device=hidden.device), last]).squeeze(-1).float()
        return scores.chunk(2)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, stats = bradley_terry_loss(*self.rewards(batch), self.margin, self.center_coef)
        self.log("rm/train_accuracy", stats["accuracy"], sync_dist=True)
        self.log("rm/train_margin", stats["margin"], sync_dist=True)
        return self.end_step(batch, loss)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        chosen, rejected = self.rewards(batch)
        _, stats = bradley_terry_loss(chosen, rejected)
        self.val_accuracy.update(stats["accuracy"], weight=len(chosen))
        self.val_margin.update(stats["margin"], weight=len(chosen))
        self.val_rewards.update(torch.cat([chosen, rejected]))

    def on_validation_epoch_end(self) -> None:
        rewards = self.val_rewards.compute()
        self.reward_mean, self.reward_std = float(rewards.mean()), float(rewards.std())
        self.log("rm/accuracy", self.val_accuracy.compute(), prog_bar=True)
        self.log("rm/margin", self.val_margin.compute())
        self.log("rm/reward_mean", self.reward_mean)
        self.log("rm/reward_std", self.reward_std)
        for metric in (self.val_accuracy, self.val_margin, self.val_rewards):
            metric.reset()

    def param_groups(self) -> list[dict]:
        """The backbone's groups, and the head in AdamW's, as the output layer it is (glm46.optim)."""
        groups = super().param_groups()
        next(group for group in groups if not group["use_muon"])["params"].append(self.score.weight)
        return groups

    def export(self, path: Path, tokenizer: GLMTokenizer | None) -> Path:
        """The backbone's HF directory, and beside it the head and the held-out reward statistics."""
        path = super().export(path, tokenizer)
        save_reward_head(path, self.score.weight, self.reward_mean, self.reward_std)
        return path

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["reward_stats"] = {"mean": self.reward_mean, "std": self.reward_std}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.reward_mean, self.reward_std = checkpoint["reward_stats"]["mean"], checkpoint["reward_stats"]["std"]
