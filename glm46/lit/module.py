"""GLM46LitModule: trains GLM46ForCausalLM with the GLM-4.5 objective and optimizer.

loss = CE + lambda_mtp(tokens) * MTP + alpha * sequence-wise balance loss, over the batch's loss mask.
Schedules (LR, MTP weight, and the callbacks' balancer rate and batch-size warm-up) read `recipe_tokens`: the
phase's start on the recipe's token clock (`recipe_start`, from the config) plus `tokens_seen`, the phase's tokens
counted over all data-parallel ranks and saved in the checkpoint. A phase started from the previous one's weights
thus continues the clock where that phase ended, and a resume or a change of batch size keeps it where it was.
The checkpoint also holds the RNG states and the step guard's state (glm46.lit.guard): a resume continues
bit for bit. Optimizer states in checkpoint files are keyed by parameter name, so that a resume under another
layout (glm46.checkpoint.reshard) finds each parameter's Muon/AdamW state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import MeanMetric

from glm46.checkpoint.atomic import resume_path
from glm46.checkpoint.fp8 import folder_block_size
from glm46.checkpoint.hf_write import save_hf
from glm46.checkpoint.hub_files import weights_folder
from glm46.checkpoint.training_state import (
    align_accumulation,
    key_optimizer_states_by_name,
    restore_rng_states,
    rng_states,
)
from glm46.checkpoint.weights import load_weights
from glm46.data.tokenizer import GLMTokenizer
from glm46.lightning_private import ends_optimizer_step
from glm46.lit.guard import StepGuard, TrainingDiverged
from glm46.modules import CausalLMOutput, GLM46Config, GLM46ForCausalLM, cuda_kernels
from glm46.modules.loss import IGNORE_INDEX
from glm46.modules.model import total_loss
from glm46.optim import muon_param_groups
from glm46.parallel.compile import compile_decoder_layers, compiled_graphs
from glm46.parallel.data_parallel import data_parallel_size
from glm46.parallel.grads import clip_grad_norm_, has_dtensor_parameters, total_grad_norm
from glm46.parallel.materialize import has_meta_tensors, materialize
from glm46.parallel.model_step import ModelStep
from glm46.peft import AdapterSettings, add_adapters, reset_adapters
from glm46.peft.fp8_base import BLOCK
from glm46.peft.merge import merge_and_unload
from glm46.peft.peft_format import load_adapter, save_adapter, unsupported
from glm46.peft.token_rows import trainable_token_ids

log = logging.getLogger(__name__)


class GLM46LitModule(L.LightningModule):
    def __init__(
        self,
        model_config: GLM46Config,
        optimizer: Callable[[list[dict]], torch.optim.Optimizer],
        lr_schedule: Callable[[int], float],  # recipe tokens -> factor of the optimizer's lr
        mtp_weight: Callable[[int], float],
        balance_loss_alpha: float = 1e-4,
        guard: StepGuard | None = None,
        empty_init: bool = False,
        init_from: str | None = None,
        recipe_start: int = 0,
        compile: bool | None = None,
        compile_backend: str = "inductor",
        peft: AdapterSettings | None = None,
    ):
        """recipe_start: tokens of the recipe before this phase (`schedule.start_tokens`; 0 for a run of its own).
        empty_init: build the model on the meta device; `configure_model` shards it and each rank materialises
        and initialises only its shards (sharded layouts: a 355B model is never whole on a rank).
        init_from: weights to start from (glm46.parallel.state.load_weights), read once the model is laid out.
        compile: torch.compile each decoder layer in place, after the layout (glm46.parallel.compile); None: on a
        CUDA device once the GPU suite has verified it (glm46.modules.cuda_kernels), off on CPU, where inductor takes
        about a minute on 2 cores. compile_backend: torch.compile's backend (`aot_eager` traces without
        generating kernels).
        peft: LoRA or DoRA adapters on the frozen base (glm46.peft), the only weights the optimizer trains; the
        export writes them in peft's format beside the merged model. None: every weight trains."""
        super().__init__()
        self.config = model_config
        with torch.device("meta") if empty_init else nullcontext():
            self.model = GLM46ForCausalLM(model_config)
            if peft is not None:
                weights = weights_folder(init_from)
                block = folder_block_size(weights) or BLOCK  # a block-FP8 base keeps init_from's blocks
                add_adapters(self.model, peft, trainable_token_ids(peft, weights), block)
        self.peft = peft
        self.init_from = init_from
        self.optimizer_factory = optimizer
        self.lr_schedule = lr_schedule
        self.mtp_weight = mtp_weight
        self.balance_loss_alpha = balance_loss_alpha
        self.guard = guard
        self.skipping_step = False  # the guard judged this optimizer step bad: no update anywhere
        self._step_loss = torch.zeros(())  # summed over the micro-batches of the step in progress
        self._step_micro_batches = 0
        self._grad_norm: torch.Tensor | None = None  # the guard's, before it drops a bad step's gradients
        self.recipe_start = recipe_start
        self.compile, self.compile_backend = compile, compile_backend
        self.tokens_seen = 0  # of this phase: the data position, and with recipe_start the schedules' clock
        self.latest_expert_counts: torch.Tensor | None = None  # of the last micro-batch, for the balancer
        self.val_loss = MeanMetric()
        self.model_step = ModelStep(self.model)  # the layout's, once configure_model laid the model out
        self._configured = False

    def configure_model(self) -> None:
        """Once: apply the strategy's layout (TP, EP, activation checkpointing, FSDP2; glm46.parallel) to the
        model, materialise a meta-device model's shards on this rank's device, then read `init_from`.
        Strategies without a layout (single device, DDP, DeepSpeed) leave the model as built. The optimizer
        is built afterwards (configure_optimizers), on the materialised shards. The strategy's `model_step` runs
        the steps' forward under its layout (glm46.parallel.model_step)."""
        if self._configured:
            return
        parallelize = getattr(self.trainer.strategy, "parallelize", None)
        if parallelize is not None:
            parallelize(self.model)
        if has_meta_tensors(self.model):
            materialize(self.model, self.trainer.strategy.root_device)
        if self.init_from:
            load_weights(self.model, self.init_from)
        if self.peft is not None:  # on the weights just read (DoRA's magnitudes are their norms)
            reset_adapters(self.model, torch.initial_seed())
            if self.peft.adapter:
                load_adapter(self.model, self.peft, self.peft.adapter)
            trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)  # DTensors: global counts
            total = sum(p.numel() for p in self.model.parameters())
            tokens = self.peft.trainable_tokens
            rows = f" and the rows of {', '.join(tokens)} tokens" if tokens else ""
            log.info(
                f"peft={self.peft.method} r={self.peft.r} on {', '.join(self.peft.targets)}{rows}: {trained:,} trained "
                f"of {total:,} parameters ({trained / total:.2%}); the base frozen in {self.peft.base_dtype}"
            )
        if self.compiles:
            compile_decoder_layers(self.model, self.compile_backend)
        model_step = getattr(self.trainer.strategy, "model_step", None)
        if model_step is not None:
            self.model_step = model_step(self.model)
        self._configured = True

    @property
    def compiles(self) -> bool:
        """Whether the decoder layers are compiled: `compile`, or where it is None, on CUDA once verified there."""
        if self.compile is not None:
            return self.compile
        return self.device.type == "cuda" and cuda_kernels.enabled("compiled_layers")

    def setup(self, stage: str) -> None:
        """DeepSpeed's engine steps its own (partitioned) optimizer and skips overflowing steps itself: no guard."""
        if self.guard is not None and isinstance(self.trainer.strategy, DeepSpeedStrategy):
            log.info("step guard off: DeepSpeed's engine skips overflowing steps itself")
            self.guard = None

    @property
    def recipe_tokens(self) -> int:
        """Where this run is on the recipe's token clock: what every schedule reads."""
        return self.recipe_start + self.tokens_seen

    def external_parameters(self) -> list[torch.nn.Parameter]:
        """Weights used outside their own module's forward: the lm_head in the chunked loss (and MTP).
        DeepSpeed ZeRO-3 must gather them for this module's whole forward and backward."""
        return [self.model.lm_head.weight]

    def forward(self, batch: dict[str, torch.Tensor], train: bool = False) -> CausalLMOutput | None:
        """The batch's loss terms, its labels masked by its loss mask. Under pipeline parallelism the layout's step
        runs the backward too when it is `train`ing, once per optimizer step: None for the batches before the
        step's last (glm46.parallel.model_step.PipelineStep)."""
        batch = {**batch, "labels": batch["labels"].masked_fill(batch["loss_mask"] == 0, IGNORE_INDEX)}
        mtp_weight = self.mtp_weight(self.recipe_tokens)
        ends_step = ends_optimizer_step(self.trainer) if train else True
        return self.model_step.forward(batch, mtp_weight, self.balance_loss_alpha, train, ends_step)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self(batch, train=True)
        mtp_weight = self.mtp_weight(self.recipe_tokens)  # where the clock was before this batch
        self.tokens_seen += batch["input_ids"].numel() * data_parallel_size(self.trainer)  # TP ranks share a batch
        if out is None:  # held for the step's last batch: nothing ran, nothing to log (Lightning needs a tensor)
            self.latest_expert_counts = None
            return torch.zeros((), device=self.device)
        loss, whole = total_loss(out, mtp_weight, self.balance_loss_alpha), self.model_step.whole
        if out.mtp_loss is not None:
            self.log("train/mtp_loss", whole(out.mtp_loss), prog_bar=True)
        if out.balance_loss is not None:
            self.log("train/balance_loss", whole(out.balance_loss))
        self.latest_expert_counts = None if out.expert_counts is None else out.expert_counts.detach()
        self._step_loss = self._step_loss.to(loss.device) + whole(loss).float()
        self._step_micro_batches += 1
        self.log("train/loss", whole(out.loss), prog_bar=True)
        self.log("train/total_loss", whole(loss))
        self.log("train/mtp_weight", mtp_weight)
        self.log("train/tokens_seen", float(self.tokens_seen))
        self.log("optim/lr", self.optimizers().param_groups[0]["lr"])
        if self.compiles:
            self.log("compile/graphs", float(compiled_graphs()))
        return self.model_step.for_backward(loss)

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        """Not when the layout's step ran the backward already (the pipeline schedule, in training_step)."""
        if not self.model_step.runs_backward:
            super().backward(loss, *args, **kwargs)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer) -> None:
        """Lightning zeroes the gradients between training_step and backward, which would drop what a step that runs
        its own backward accumulated: those are zeroed after each optimizer step instead."""
        if not self.model_step.runs_backward:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        norm = self._grad_norm if self.guard is not None else total_grad_norm(self.parameters(), self.model_step.group)
        self.log("optim/grad_norm", norm)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        """Lightning's step, with the guard's verdict taken right after the last backward of the step,
        before the callbacks (the balancer) and the optimizer act on it."""

        def closure():
            result = optimizer_closure()
            self.model_step.finish_backward()
            if self.guard is not None:
                self._judge_step(optimizer)
            return result

        optimizer.step(closure=closure)
        if self.model_step.runs_backward:
            optimizer.zero_grad(set_to_none=True)

    def _judge_step(self, optimizer) -> None:
        loss = self.trainer.strategy.reduce(self._step_loss / max(self._step_micro_batches, 1), reduce_op="mean")
        self._step_loss, self._step_micro_batches = torch.zeros(()), 0
        self._grad_norm = total_grad_norm(self.parameters(), self.model_step.group)
        reason = self.guard.judge(float(loss), float(self._grad_norm))
        self.skipping_step = reason is not None
        if self.skipping_step:
            optimizer.zero_grad(set_to_none=True)  # optimizers skip parameters without a gradient
            log.warning(f"step {self.trainer.global_step}: skipped, {reason} ({self.guard.bad_in_a_row} bad in a row)")
        self.log("guard/skipped_steps", float(self.guard.skipped))

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if self.guard is not None and self.skipping_step and self.guard.must_act:
            self._roll_back()

    def _roll_back(self) -> None:
        """Restore the newest checkpoint's weights and optimizer state; keep the data position."""
        guard, step = self.guard, self.trainer.global_step - 1  # the bad step just counted
        directory = getattr(self.trainer.checkpoint_callback, "dirpath", None)
        path = resume_path("last", Path(directory)) if directory else None
        why = f"step {step}: {guard.bad_in_a_row} bad steps in a row"
        if guard.on_repeated == "stop" or path is None or guard.rollbacks >= guard.max_rollbacks:
            reason = (
                "guard.on_repeated=stop"
                if guard.on_repeated == "stop"
                else "no checkpoint to roll back to"
                if path is None
                else f"already rolled back guard.max_rollbacks={guard.max_rollbacks} times"
            )
            raise TrainingDiverged(f"{why} ({reason}); the run stops. Newest checkpoint: {path}")
        checkpoint = self.trainer.strategy.load_checkpoint(path)
        self.trainer.strategy.load_model_state_dict(checkpoint)
        self.trainer.strategy.load_optimizer_state_dict(checkpoint)
        guard.rolled_back()
        log.warning(
            f"{why}: rolled back to the weights and optimizer state of {path} (step "
            f"{checkpoint['global_step']}); training goes on with the batches after the bad ones"
        )

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Lightning's clipping, except for sharded (DTensor) weights, whose global norm glm46.parallel computes over
        every weight the optimizer steps (the model's, and a head's beside it; a critic's has its own optimizer)."""
        group = self.model_step.group
        sharded = has_dtensor_parameters(self.model) or group is not None
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm") and sharded:
            stepped = [p for param_group in optimizer.param_groups for p in param_group["params"]]
            clip_grad_norm_(stepped, gradient_clip_val, group)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.val_loss.update(self.model_step.whole(self(batch).loss))

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", torch.exp(loss))

    def param_groups(self) -> list[dict]:
        """What the optimizer trains, in Muon's and AdamW's groups (glm46.optim.muon_param_groups); with adapters,
        they alone (and an embedding or lm_head named to train), in AdamW's group at peft.lr."""
        if self.peft is None:
            return muon_param_groups(self.model)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return [{"params": trainable, "use_muon": False, "lr": self.peft.lr, "weight_decay": self.peft.weight_decay}]

    @property
    def moves_routing_bias(self) -> bool:
        """Whether the balancer moves the routers' correction biases: not under adapters, which keep routing frozen."""
        return self.peft is None

    def configure_optimizers(self):
        return self.scheduled(self.optimizer_factory(self.param_groups()))

    def scheduled(self, optimizer: torch.optim.Optimizer) -> dict:
        """An optimizer with the recipe's LR schedule, stepped every optimizer step, as configure_optimizers returns
        it."""
        scheduler = LambdaLR(optimizer, lambda _: self.lr_schedule(self.recipe_tokens))  # a factor of each group's lr
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def export(self, path: Path, tokenizer: GLMTokenizer | None) -> Path:
        """The final weights as an HF directory (glm46.checkpoint.save_hf), with the tokenizer beside them. Every rank
        calls it: sharded weights are gathered. With adapters: first the adapters in peft's format (`adapter/` beside
        `path`) where the format holds them, then the merged model at `path` (the adapters are folded in: the
        module trains no further)."""
        if self.peft is not None:
            reason = unsupported(self.peft)
            if reason is None:
                save_adapter(self.model, self.peft, path.parent / "adapter", base_model=self.init_from)
            else:
                log.warning(f"no {path.parent / 'adapter'}: {reason}; {path} holds the merged model")
            merge_and_unload(self.model)
        return save_hf(self.model, path, tokenizer=tokenizer)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Beside the weights: the token clock, the accumulation, the generators' and the guard's states, and the
        optimizer states keyed by parameter name (glm46.checkpoint.training_state)."""
        checkpoint["tokens_seen"] = self.tokens_seen
        checkpoint["accumulate_grad_batches"] = self.trainer.accumulate_grad_batches
        checkpoint["rng_states"] = rng_states()
        if self.guard is not None:
            checkpoint["guard"] = self.guard.state_dict()
        key_optimizer_states_by_name(checkpoint, self.trainer, self)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        align_accumulation(checkpoint, self.trainer)
        self.tokens_seen = checkpoint["tokens_seen"]
        if "rng_states" in checkpoint:
            restore_rng_states(checkpoint["rng_states"])
        if self.guard is not None and "guard" in checkpoint:
            self.guard.load_state_dict(checkpoint["guard"])
