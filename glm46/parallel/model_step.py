"""What a training or validation step needs from the layout beyond the model's own forward: the strategy's small
per-step object (MeshParallelStrategy.model_step), so that the LightningModule speaks of the loss only.

- `ModelStep`: the model on this rank's batch, whole or split by tensors (TP, EP, FSDP2), and under context and
  sequence parallelism on this rank's tokens of it (glm46.parallel.sharded_tokens): each rank's loss is then its
  tokens' part, summed for the logs; the loss backpropagated is scaled by cp (FSDP2 averages the gradients over
  the cp ranks too, where they must sum); and after the step's last backward the gradients of the weights that
  saw only the rank's tokens are summed over TP (glm46.parallel.sequence_parallel).
- `PipelineStep`: the step's batches through one pipeline schedule (glm46.parallel.pipeline_parallel), which runs
  the backward of every microbatch itself: a training batch that does not end its optimizer step is held until the
  one that does, and the step's batches run together, as the microbatches of one schedule. Its loss terms arrive
  summed over the stages, and this rank's parameters are a part of the model's, over the pipeline group.
"""

from __future__ import annotations

import torch
from torch import nn

from glm46.modules.token_split import WHOLE_ROWS

from .pipeline_parallel import Pipeline, step_totals
from .sequence_parallel import all_reduce_sequence_local_grads
from .sharded_tokens import ShardedTokens

Batch = dict[str, torch.Tensor]


class ModelStep:
    """The model's forward on a batch whose labels are masked already; `forward` leaves the backward to Lightning."""

    runs_backward = False  # whether `forward` ran the backward too
    group = None  # the process group over which this rank's parameters are a part of the model's (a pipeline's)

    def __init__(self, model: nn.Module, split: ShardedTokens | None = None, experts_fold_tp: bool = False):
        """split: the layout's token split (glm46.parallel.sharded_tokens.token_split); experts_fold_tp: the layout's
        (whether the routed experts are split over TP, so that their gradients are not partial sums)."""
        self.model, self.split, self.experts_fold_tp = model, split, experts_fold_tp

    def forward(self, batch: Batch, mtp_weight: float, balance_alpha: float, train: bool, ends_step: bool = True):
        """The batch's loss terms (CausalLMOutput); the weights and `ends_step` (whether the batch is the last of its
        optimizer step) serve the pipeline's step."""
        split = WHOLE_ROWS if self.split is None else self.split
        input_ids, labels, position_ids = batch["input_ids"], batch["labels"], batch.get("position_ids")
        return self.model(input_ids, labels=labels, position_ids=position_ids, split=split)

    def whole(self, value: torch.Tensor) -> torch.Tensor:
        """A loss term as one process has it (detached): this rank's tokens' part summed under a token split."""
        return value.detach() if self.split is None else self.split.sum(value)

    def for_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Each cp rank's loss is its tokens' part, and FSDP2 averages the gradients over the cp ranks too: the sum."""
        return loss if self.split is None else loss * self.split.context_size

    def finish_backward(self) -> None:
        """Once the step's last backward is done: the gradients of the weights that saw this rank's tokens only,
        summed over the sequence-parallel (TP) ranks."""
        if self.split is not None and self.split.sequence is not None:
            all_reduce_sequence_local_grads(self.model, self.split.sequence.group, self.experts_fold_tp)

    def whole_model_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-MoE-layer rows of this rank's layers (expert counts) -> those of the whole model."""
        return rows


class PipelineStep(ModelStep):
    """The batch through this rank's pipeline stages and schedule."""

    runs_backward = True

    def __init__(self, model: nn.Module, pipeline: Pipeline, split: ShardedTokens | None, experts_fold_tp: bool):
        super().__init__(model, split, experts_fold_tp)
        self.pipeline, self.group = pipeline, pipeline.group
        self.held: list[Batch] = []  # the training batches of the optimizer step in progress

    def forward(self, batch: Batch, mtp_weight: float, balance_alpha: float, train: bool, ends_step: bool = True):
        """Every microbatch's forward, and with `train` its backward; the loss terms without a graph. A training
        batch that does not end its optimizer step is held and None returned: the step's batches run once the
        last arrives, each split into the layout's microbatches, all in one schedule."""
        batches = [batch]
        if train:
            self.held.append(batch)
            if not ends_step:
                return None
            batches, self.held = self.held, []
            batch = {key: torch.cat([b[key] for b in batches]) for key in batch}
        totals = step_totals(batch, self.pipeline.config, mtp_weight, balance_alpha)
        return self.pipeline.step(batch, totals, self.pipeline.layout.microbatches * len(batches), train)

    def whole(self, value: torch.Tensor) -> torch.Tensor:
        return value.detach()  # summed over the stages and the TP ranks by Pipeline.step

    def whole_model_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.pipeline.whole_model_rows(rows)
