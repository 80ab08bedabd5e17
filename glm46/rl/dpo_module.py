"""DPOLitModule: Direct Preference Optimization (arXiv:2305.18290) on preference pairs, or IPO (arXiv:2310.12036).

The policy starts from an SFT export (`init_from`); the reference is that starting policy. Its log-probs of every
pair (train and held-out) are computed once before the first step, shared out over the data-parallel ranks and
gathered (TRL's `precompute_ref_log_probs`), and served with the batches (glm46.lit.preference_data): no second
model is held in memory, and a resumed run reads the table from its checkpoint (the DataModule's state) instead of
computing it from weights that have moved. A reply's log-prob is the sum of its tokens' (glm46.rl.core_algos.
token_logprobs, the [tokens, vocabulary] logits in chunks), and the loss glm46.rl.preference_loss.dpo_loss.

Logged: `train/loss`, `rewards/chosen`, `rewards/rejected`, `rewards/accuracies`, `rewards/margins` (TRL's names),
and on the held-out pairs `val/loss`, `val/rewards/accuracies`, `val/rewards/margins`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torchmetrics import MeanMetric

from glm46.lit.preference_data import PreferenceDataModule
from glm46.logs import rank_zero_logger
from glm46.modules.loss import IGNORE_INDEX
from glm46.parallel.data_parallel import data_parallel_group, data_parallel_rank_and_size
from glm46.peft import adapters_disabled
from glm46.rl.core_algos import token_logprobs
from glm46.rl.preference_loss import DPO_LOSSES, dpo_loss, sequence_logprobs
from glm46.rl.preference_module import PreferenceLitModule

log = rank_zero_logger(__name__)


class DPOLitModule(PreferenceLitModule):
    def __init__(
        self,
        *args,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        sft_weight: float = 0.0,
        reference_batch_size: int = 16,
        **kwargs,
    ):
        """The GLM46LitModule arguments, plus DPO's `beta` (the strength of the pull to the reference), `loss_type`
        (sigmoid: DPO; ipo: IPO), `sft_weight` (the weight of the chosen replies' negative log-likelihood added to the
        loss: RPO's alpha; 0: none) and the pairs per forward when the reference log-probs are computed."""
        if loss_type not in DPO_LOSSES:
            raise ValueError(f"module.loss_type={loss_type!r}: expected one of {', '.join(DPO_LOSSES)}")
        if not beta > 0:
            raise ValueError(f"module.beta={beta} must be > 0")
        if not sft_weight >= 0:
            raise ValueError(f"module.sft_weight={sft_weight} must be >= 0")
        super().__init__(*args, **kwargs)
        self.beta, self.loss_type, self.sft_weight = beta, loss_type, sft_weight
        self.reference_batch_size = reference_batch_size
        self.val_metrics = nn.ModuleDict({name: MeanMetric() for name in ("loss", "accuracies", "margins")})

    def sequence_logps(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed reply log-probs [B] of the chosen and the rejected sides, in one forward of both."""
        hidden = self.pair_hidden_states(batch)
        ids, mask = self.both_sides(batch, "ids"), self.both_sides(batch, "mask")
        targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)  # the state at t predicts token t + 1
        logps = token_logprobs(hidden[:, :-1], self.model.lm_head.weight, targets, 1.0, self.model.loss_chunk_size)
        return sequence_logprobs(logps, mask[:, 1:]).chunk(2)

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        chosen, rejected = self.sequence_logps(batch)
        return dpo_loss(
            chosen,
            rejected,
            batch["ref_chosen_logps"],
            batch["ref_rejected_logps"],
            self.beta,
            self.loss_type,
            batch["chosen_mask"].sum(dim=1),
            batch["rejected_mask"].sum(dim=1),
            self.sft_weight,
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, stats = self.loss(batch)
        for name, value in stats.items():
            self.log(name, value, sync_dist=True)
        return self.end_step(batch, loss)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, stats = self.loss(batch)
        weight = len(batch["chosen_ids"])
        self.val_metrics["loss"].update(loss, weight=weight)
        for name in ("accuracies", "margins"):
            self.val_metrics[name].update(stats[f"rewards/{name}"], weight=weight)

    def on_validation_epoch_end(self) -> None:
        for name, metric in self.val_metrics.items():
            self.log("val/loss" if name == "loss" else f"val/rewards/{name}", metric.compute(), prog_bar=name == "loss")
            metric.reset()

    # -- the reference, once
    def on_fit_start(self) -> None:
        """The starting policy's log-probs of every pair, unless the DataModule's state (a resume) holds them."""
        data = self.trainer.datamodule
        if not isinstance(data, PreferenceDataModule):
            raise TypeError(f"DPO trains on data=preference, not {type(data).__name__}")
        if data.reference is None:
            data.reference = self.reference_logps(data)

    @torch.no_grad()
    def reference_logps(self, data: PreferenceDataModule) -> dict[str, dict[str, np.ndarray]]:
        """split -> domain -> [pairs, 2] (chosen, rejected): each data-parallel rank computes every ranks-th pair
        (all ranks the same number of forwards, which sharded models need), then all gather them."""
        rank, ranks = data_parallel_rank_and_size(self.trainer)
        every = data.every_pair()
        pairs = [(split, domain, dataset, item) for split, domains in every.items()
                 for domain, dataset in domains.items() for item in range(len(dataset.bins[0]))]  # fmt: skip
        share = math.ceil(len(pairs) / ranks)
        mine = [pairs[min(index, len(pairs) - 1)] for index in range(rank, share * ranks, ranks)]
        log.info(f"DPO reference: the starting policy's log-probs of {len(pairs)} pairs ({share} on each rank)")
        was_training = self.training
        self.eval()
        values = []
        with adapters_disabled(self.model):  # under peft=lora|dora the reference is the base alone: no second model
            for start in range(0, len(mine), self.reference_batch_size):
                rows = [dataset.sample(0, i) for _, _, dataset, i in mine[start : start + self.reference_batch_size]]
                batch = {key: torch.from_numpy(np.stack([row[key] for row in rows])).to(self.device) for key in rows[0]}
                values.append(torch.stack(self.sequence_logps(batch), dim=1).float())
        self.train(was_training)
        local = torch.cat(values) if values else torch.zeros(0, 2, device=self.device)
        if ranks > 1:
            gathered = [torch.empty_like(local) for _ in range(ranks)]
            torch.distributed.all_gather(gathered, local, group=data_parallel_group(self.trainer.strategy))
            local = torch.stack(gathered, dim=1).reshape(-1, 2)  # pair i came from rank i % ranks
        table, reference, used = local[: len(pairs)].cpu().numpy(), {}, 0
        for split, domains in every.items():  # pairs lie split by split, domain by domain, item by item
            for domain, dataset in domains.items():
                count = len(dataset.bins[0])
                reference.setdefault(split, {})[domain] = table[used : used + count]
                used += count
        return reference
