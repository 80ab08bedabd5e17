"""GLM46LitModule: trains GLM46ForCausalLM with the GLM-4.5 objective and optimizer.

loss = CE + lambda_mtp(tokens) * MTP + alpha * sequence-wise balance loss, over the batch's loss mask.
Schedules (LR, MTP weight) read `tokens_seen`, which is counted over all data-parallel ranks and
saved in the checkpoint, so a resume or a change of batch size keeps them where they were.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import MeanMetric

from glm46.modules import GLM46Config, GLM46ForCausalLM
from glm46.modules.loss import IGNORE_INDEX
from glm46.optim import muon_param_groups
from glm46.parallel.grads import clip_grad_norm_, has_dtensor_parameters, total_grad_norm
from glm46.parallel.strategies import data_parallel_size


class GLM46LitModule(L.LightningModule):
    def __init__(
        self,
        model_config: GLM46Config,
        optimizer: Callable[[list[dict]], torch.optim.Optimizer],
        lr_schedule: Callable[[int], float],
        mtp_weight: Callable[[int], float],
        balance_loss_alpha: float = 1e-4,
    ):
        super().__init__()
        self.config = model_config
        self.model = GLM46ForCausalLM(model_config)
        self.optimizer_factory = optimizer
        self.lr_schedule = lr_schedule
        self.mtp_weight = mtp_weight
        self.balance_loss_alpha = balance_loss_alpha
        self.tokens_seen = 0
        self.latest_expert_counts: torch.Tensor | None = None  # of the last micro-batch, for the balancer
        self.val_loss = MeanMetric()
        self._parallelized = False

    def configure_model(self) -> None:
        """Apply the strategy's layout (TP, EP, FSDP2; glm46.parallel) to the model, once. Strategies
        without one (single device, DDP, DeepSpeed) leave the model as built."""
        parallelize = getattr(self.trainer.strategy, "parallelize", None)
        if parallelize is not None and not self._parallelized:
            parallelize(self.model)
            self._parallelized = True

    def external_parameters(self) -> list[torch.nn.Parameter]:
        """Weights used outside their own module's forward: the lm_head in the chunked loss (and MTP).
        DeepSpeed ZeRO-3 must gather them for this module's whole forward and backward."""
        return [self.model.lm_head.weight]

    def forward(self, batch: dict[str, torch.Tensor]):
        labels = batch["labels"].masked_fill(batch["loss_mask"] == 0, IGNORE_INDEX)
        return self.model(batch["input_ids"], labels=labels, position_ids=batch.get("position_ids"))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self(batch)
        mtp_weight = self.mtp_weight(self.tokens_seen)
        loss = out.loss
        if out.mtp_loss is not None:
            loss = loss + mtp_weight * out.mtp_loss
            self.log("train/mtp_loss", out.mtp_loss, prog_bar=True)
        if out.balance_loss is not None:
            loss = loss + self.balance_loss_alpha * out.balance_loss
            self.log("train/balance_loss", out.balance_loss)
        self.latest_expert_counts = None if out.expert_counts is None else out.expert_counts.detach()
        self.tokens_seen += batch["input_ids"].numel() * data_parallel_size(self.trainer)  # TP ranks share a batch
        self.log("train/loss", out.loss, prog_bar=True)
        self.log("train/total_loss", loss)
        self.log("train/mtp_weight", mtp_weight)
        self.log("train/tokens_seen", float(self.tokens_seen))
        self.log("optim/lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log("optim/grad_norm", total_grad_norm(self.parameters()))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Lightning's clipping, except for sharded (DTensor) weights, whose global norm glm46.parallel computes."""
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm") and has_dtensor_parameters(self.model):
            clip_grad_norm_(self.model.parameters(), gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.val_loss.update(self(batch).loss)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", torch.exp(loss))

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(muon_param_groups(self.model))
        peak = optimizer.param_groups[0]["lr"]
        scheduler = LambdaLR(optimizer, lambda _: self.lr_schedule(self.tokens_seen) / peak)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.tokens_seen = checkpoint["tokens_seen"]
