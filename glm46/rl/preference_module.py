"""PreferenceLitModule: what the modules that learn from preference pairs (glm46.lit.preference_data) share.

Both sides of a batch's pairs go through the model in one forward, chosen rows first ([2B, T]); the final norm's
output is what the reward model's head and DPO's log-probs read (`GLM46ForCausalLM.hidden_states`, registered as an
FSDP2 forward method so that the root's weights are gathered for it). The MTP layers are not trained (frozen, so
that DDP and FSDP2 find no parameter without a gradient); subclasses name what else they leave (`frozen_modules`).
`tokens_seen` counts seq_len tokens per pair, so that ShardDataModule's position counts pairs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from glm46.lit.module import GLM46LitModule
from glm46.parallel.data_parallel import data_parallel_size


class PreferenceLitModule(GLM46LitModule):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for module in self.frozen_modules():
            module.requires_grad_(False)

    def frozen_modules(self) -> list[nn.Module]:
        """The model's parts this module does not train."""
        return list(self.model.mtp_layers)

    def configure_model(self) -> None:
        super().configure_model()
        if isinstance(self.model, FSDPModule):
            register_fsdp_forward_method(self.model, "hidden_states")

    @staticmethod
    def both_sides(batch: dict[str, torch.Tensor], key: str) -> torch.Tensor:
        """The chosen rows' `key` then the rejected rows'."""
        return torch.cat([batch[f"chosen_{key}"], batch[f"rejected_{key}"]])

    def pair_hidden_states(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The final normed hidden states [2B, T, hidden] of both sides, chosen rows first."""
        ids = self.both_sides(batch, "ids")
        return self.model.hidden_states(ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids))

    def end_step(self, batch: dict[str, torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
        """A training step's bookkeeping, returning its loss: the token clock (seq_len tokens per pair over the
        data-parallel ranks), the step guard's loss, and the logged loss, LR and tokens."""
        self.tokens_seen += batch["chosen_ids"].numel() * data_parallel_size(self.trainer)
        self._step_loss = self._step_loss.to(loss.device) + loss.detach()
        self._step_micro_batches += 1
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)  # the mean over the ranks' equal batches
        self.log("train/tokens_seen", float(self.tokens_seen))
        self.log("optim/lr", self.optimizers().param_groups[0]["lr"])
        return loss
