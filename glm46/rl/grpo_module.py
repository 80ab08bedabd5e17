"""GRPOLitModule: reinforcement learning on verifiable answers with GRPO, as GLM-4.5 trained its reasoning RL.

GLM-4.5 (arXiv:2508.06471, section 3.2) runs GRPO without the KL term on prompts whose answers are checked,
in slime (github.com/THUDM/slime). One rollout batch per training step:
1. Each of the step's prompts is sampled `samples_per_prompt` times at `temperature` by the rollout worker
   (glm46.rl.rollout_worker: the model's KV-cache `generate` or a vLLM engine, single completions or tool episodes); a
   completion ends at GLM's first stop token (<|endoftext|>, <|user|>, <|observation|>) or after `max_new_tokens`.
2. Rewards come from glm46.rl.rewards.verify (1 for the right final integer, else 0), or for a code prompt from
   glm46.rl.code_reward (the share of its tests passed in the sandbox; a row the sandbox could not score takes its
   group's mean reward and is left out of the loss), and a reward model where set (glm46.rl.rlhf); advantages are
   normalised within each prompt's group (glm46.rl.core_algos.group_advantages).
3. `epochs` passes of `updates_per_rollout` optimizer updates, each on its share of the rollout: the clipped
   policy-ratio loss against the rollout policy's log-probs (glm46.rl.core_algos.policy_loss), token mean over
   completion tokens.

With `phase.grpo.dynamic_sampling=true` (DAPO's dynamic sampling, glm46.rl.dynamic_sampling), groups whose rewards
are all equal are dropped and refilled from the next rollout batches before an update: a batch that only draws
takes no optimizer step, and the data position advances at the update. Lightning keeps a step metric's last value,
so such a batch's row in the logs repeats the last update's `train/loss` and `rl/draws`.

Rollouts and updates alternate within a step, so the module optimizes manually (Lightning's
`automatic_optimization = False`); the global step counts optimizer updates. As slime's GLM scripts do, the
router's correction bias stays frozen (balancer rate 0) and the sequence-aux loss is off during RL: the
experiment sets both. The MTP layers are not trained here (slime trains them only with
--enable-mtp-training). Sampling is seeded per completion (glm46.rl.rollout_worker), so a resumed run draws the same
completions as an uninterrupted one, and N data-parallel processes (ddp, fsdp2, the expert layouts; each rolls out
its share of the prompts, whole groups) the same as one. The token mean of the loss counts every rank's completion
tokens.

With `phase.rollout.engine=vllm` the loss weighs each token by the truncated importance ratio between the
trainer's and the engine's log-probs; the policy's weights are pushed to the engine before each rollout that follows
an update. Validation stays greedy through `generate`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra.utils import get_method
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from glm46.data.tokenizer import GLMTokenizer
from glm46.lit.callbacks.preemption import Preemption
from glm46.lit.module import GLM46LitModule
from glm46.logs import rank_zero_logger
from glm46.modules import GLM46ForCausalLM
from glm46.parallel.data_parallel import data_parallel_group, data_parallel_rank_and_size
from glm46.peft import adapters_disabled
from glm46.peft.settings import TRAINED_WHOLE
from glm46.rl.code_reward import Verifier
from glm46.rl.core_algos import (
    flat_groups,
    group_advantages,
    policy_loss,
    token_logprobs,
    truncated_importance_weights,
    unscored_filled,
    width_groups,
)
from glm46.rl.dynamic_sampling import Refill
from glm46.rl.dynamic_temperature import DynamicTemperature
from glm46.rl.engine import RolloutEngineError, RolloutSettings
from glm46.rl.grpo_settings import GRPOSettings
from glm46.rl.reference import starting_policy
from glm46.rl.rlhf import MixedReward, RewardSettings, monitor_scores, row_lengths
from glm46.rl.rollout_batch import Rollout
from glm46.rl.rollout_worker import RolloutWorker
from glm46.rl.turns import completion_seed
from glm46.sandbox import Sandbox

log = rank_zero_logger(__name__)


class GRPOLitModule(GLM46LitModule):
    def __init__(
        self,
        *args,
        tokenizer_path: str,
        grpo: GRPOSettings,
        rollout: RolloutSettings | None = None,
        gradient_clip_val: float | None = None,
        seed: int = 0,
        reward_mix: RewardSettings | None = None,
        reward: Callable[[Mapping, str], float | None] | None = None,
        **kwargs,
    ):
        """The GLM46LitModule arguments, plus the RL phase's GRPO settings (`phase.grpo`; conf/module/grpo.yaml),
        where its rollouts are sampled (`phase.rollout`; None: the model's own generate) and how they are scored
        (`phase.reward`: the verifier, and a reward model when set; glm46.rl.rlhf). reward(record, completion text)
        is the verifier of a completion of a prompt record {"answer": int, "tests": [...]} (None: glm46.rl.code_reward's
        Verifier, code prompts in phase.reward.sandbox); it returns None where it could not score."""
        super().__init__(*args, **kwargs)
        self.model.mtp_layers.requires_grad_(False)  # not trained in RL (DDP would find them unused in the loss)
        self.automatic_optimization = False
        self.tokenizer = GLMTokenizer.from_file(tokenizer_path)
        self.grpo = grpo
        self.rollout_settings = rollout or RolloutSettings()
        self.gradient_clip_val, self.seed = gradient_clip_val, seed
        self.reward_mix = reward_mix or RewardSettings()
        verifier = reward or Verifier(Sandbox(self.reward_mix.sandbox))
        self.worker = RolloutWorker(
            self.model, self.tokenizer, grpo, self.rollout_settings, verifier, seed, lambda: self.device
        )
        self.mixed_reward = MixedReward(self.reward_mix, Path(tokenizer_path), torch.device("cpu"))  # not a submodule
        self.monitor = get_method(self.reward_mix.monitor) if self.reward_mix.monitor else None
        self.reference: list[GLM46ForCausalLM] = []  # a list: held, not registered (not trained, not checkpointed)
        self.prompts_seen = 0  # over all data-parallel ranks: the data position (glm46.rl.prompts)
        self.prompts_drawn = 0  # since the last update, over all ranks: added to prompts_seen at the next update
        self.refill = Refill(grpo.samples_per_prompt, self.worker.pad_id) if grpo.dynamic_sampling else None
        self.dynamic_temperature = DynamicTemperature(grpo.dynamic_temperature, grpo.temperature)
        self.val_rewards: list[torch.Tensor] = []
        self.val_watched: dict[str, list[torch.Tensor]] = {"monitor": [], "rm_reward": []}  # single-turn validation

    @property
    def temperature(self) -> float:
        """The sampling temperature: phase.grpo.temperature, raised at plateaus by dynamic_temperature."""
        return self.dynamic_temperature.value

    @property
    def compiles(self) -> bool:
        """Only when asked (`module.compile=true`): the rollouts decode at every length, each a new shape."""
        return bool(self.compile)

    def configure_model(self) -> None:
        """The layout, then: under FSDP2 (fsdp2 and the expert layouts) generate and hidden_states run FSDP's forward
        hooks like forward does (the root's embedding, final norm and lm_head gathered), as they are called instead
        of it."""
        super().configure_model()
        if isinstance(self.model, FSDPModule):
            for method in ("generate", "hidden_states"):
                register_fsdp_forward_method(self.model, method)
        self.mixed_reward.to(self.device)
        if self.uses_reference and not self.reference_is_the_base:
            self.reference = [starting_policy(self.config, self.init_from, self.device)]

    @property
    def uses_reference(self) -> bool:
        """Whether the starting policy's log-probs are needed: for GRPO's KL term (phase.grpo.kl_coef > 0)."""
        return self.grpo.kl_coef > 0

    @property
    def reference_is_the_base(self) -> bool:
        """Under adapters (peft=lora|dora, no layer trained whole) the reference is the frozen base with its adapters
        switched off, so no copy is held (TRL's way with peft); with peft.adapter, the base, not the adapter given."""
        return self.peft is not None and not self.peft.target_names() & set(TRAINED_WHOLE)

    @torch.no_grad()
    def reference_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The starting policy's log-probs [N, T] of the targets, at the sampling temperature."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        if self.reference_is_the_base:
            with adapters_disabled(self.model):
                return self._logprobs_of(self.model, input_ids, positions, targets)
        return self._logprobs_of(self.reference[0], input_ids, positions, targets)

    def _logprobs_of(self, model: GLM46ForCausalLM, input_ids, positions, targets) -> torch.Tensor:
        hidden = model.hidden_states(input_ids, positions)
        return token_logprobs(hidden, model.lm_head.weight, targets, self.temperature, self.model.loss_chunk_size)

    # -- rollout (glm46.rl.rollout_worker)
    def push_weights(self) -> None:
        """The policy's weights into the engine (the first push starts it)."""
        root = Path(self.trainer.default_root_dir) / "rollout"
        self.log("perf/weight_push_s", self.worker.push_weights(root, self.trainer.global_step))

    def checkpointed(self, error: RolloutEngineError) -> RolloutEngineError:
        """Save the state before this step (nothing of it has been trained) as `last.ckpt`, and the error to raise."""
        path = Preemption.checkpoint_path(self.trainer)
        self.trainer.save_checkpoint(path)
        return RolloutEngineError(
            f"{error}\nThe run stops: {path} holds step {self.trainer.global_step}; `ckpt_path=last` resumes from it."
        )

    def teardown(self, stage: str) -> None:
        """The engine ends with the run (glm46.rl.rollout_worker.RolloutWorker.close)."""
        self.worker.close(Path(self.trainer.default_root_dir) / "rollout")

    def rollout(self, batch: dict[str, torch.Tensor]) -> Rollout:
        started = time.perf_counter()
        rollout, verified, episodes = self.worker.collect(batch, self.temperature)
        seconds = time.perf_counter() - started
        for name, value in episodes.items():
            self.log(f"rl/{name}", value, sync_dist=True)
        unscored = verified.isnan()  # the sandbox could not score them: no reward, and out of the loss
        self.log("rl/unscored", unscored.float().mean(), sync_dist=True)
        if unscored.any():
            verified = unscored_filled(verified, self.grpo.samples_per_prompt)
            rollout.mask[unscored] = 0.0
        rewards, parts = self.mixed_reward(verified, rollout.input_ids, row_lengths(rollout.mask))
        rollout.rewards, rollout.advantages = rewards, self.estimate_advantages(rollout, rewards)
        lengths = rollout.mask.sum(1)  # the model's own tokens
        # Over the data-parallel ranks (each holds as many prompts): means, and the throughput summed.
        self.log("rl/reward_mean", rewards.mean(), prog_bar=True, sync_dist=True)
        self.log("rl/accuracy", (verified == 1).float().mean(), sync_dist=True)
        for name, value in parts.items():
            self.log(f"rl/{name}", value, sync_dist=True)
        if self.monitor is not None:
            monitored = monitor_scores(self.monitor, self.tokenizer, rollout.input_ids, rollout.mask)
            self.log("rl/monitor", monitored.mean().to(self.device), sync_dist=True)
        # Groups whose rewards are all equal have advantages 0: no gradient (dynamic sampling drops them).
        flat = flat_groups(rewards, self.grpo.samples_per_prompt)
        self.log("rl/flat_groups", flat.float().mean(), sync_dist=True)
        self.log("rl/completion_length", lengths.float().mean(), sync_dist=True)
        self.log("perf/rollout_tokens_per_sec", float(lengths.sum()) / seconds, sync_dist=True, reduce_fx="sum")
        return rollout

    def refilled(self, rollout: Rollout, groups: int) -> Rollout | None:
        """Dynamic sampling (glm46.rl.dynamic_sampling): the update's `groups` groups once every data-parallel rank
        holds that many varied ones or has drawn max_draws rollout batches; None before."""
        self.refill.add(rollout)
        varied = torch.tensor(len(self.refill.varied), device=self.device)
        if data_parallel_rank_and_size(self.trainer)[1] > 1:  # ranks draw in step: the same count of batches
            group = data_parallel_group(self.trainer.strategy)
            torch.distributed.all_reduce(varied, op=torch.distributed.ReduceOp.MIN, group=group)
        if varied < groups and self.refill.draws < self.grpo.max_draws:
            return None
        draws = self.refill.draws
        rollout, filled = self.refill.take(groups)
        self.log("rl/draws", float(draws), sync_dist=True)  # rollout batches this update drew
        self.log("rl/filled_flat", filled / groups, sync_dist=True)  # its share of flat groups (max_draws reached)
        return rollout

    def estimate_advantages(self, rollout: Rollout, rewards: torch.Tensor) -> torch.Tensor:
        """GRPO's: each reward against its prompt's group [N]."""
        return group_advantages(rewards, self.grpo.samples_per_prompt, self.grpo.scale_rewards)

    def minibatches(self, rollout: Rollout) -> Iterator[Rollout]:
        """The rollout's updates: `epochs` passes, each in `updates_per_rollout` shares of its rows, the first pass in
        order (whole groups), the later ones in a shuffle seeded by (seed, step, epoch), as verl and TRL shuffle
        their PPO epochs. The sampling policy's log-probs of every share but the first are taken before the first
        update moves it; the first share's are its own at its update, detached (a forward saved)."""
        parts = rollout.split(self.grpo.updates_per_rollout)
        with torch.no_grad():
            for part in parts[1:]:
                if part.old_logprobs is None:
                    part.old_logprobs = self.logprobs(part.input_ids, part.targets)[0]
        yield from parts
        if self.grpo.epochs == 1:
            return
        whole = Rollout.concatenated(parts, self.worker.pad_id)  # the first share's old log-probs taken at its update
        for epoch in range(1, self.grpo.epochs):
            generator = torch.Generator().manual_seed(completion_seed(self.seed, self.trainer.global_step, epoch))
            order = torch.randperm(len(whole.input_ids), generator=generator).to(whole.input_ids.device)
            yield from whole.select(order).split(self.grpo.updates_per_rollout)

    # -- update
    def logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs [N, T] of the targets under the policy at the sampling temperature, and the entropies. Rows of
        multi-turn episodes (max_turns > 1), whose lengths differ most, run in two forwards of similar lengths, each
        cut after its last target (width_groups); single-turn rows in one (a second forward costs the toy more than
        the padding it saves)."""
        weight, chunk, width = self.model.lm_head.weight, self.model.loss_chunk_size, targets.shape[1]
        groups = width_groups(targets) if self.grpo.max_turns > 1 else [(torch.arange(len(targets)), width)]
        parts = []
        for rows, length in groups:
            ids = input_ids[rows, :length]
            hidden = self.model.hidden_states(ids, torch.arange(length, device=ids.device).expand_as(ids))
            logprobs, entropy = token_logprobs(
                hidden, weight, targets[rows, :length], self.temperature, chunk, return_entropy=True
            )
            parts.append([F.pad(part, (0, width - length)) for part in (logprobs, entropy)])
        order = torch.argsort(torch.cat([rows for rows, _ in groups]))
        logprobs, entropy = (torch.cat(column)[order] for column in zip(*parts))
        return logprobs, entropy

    def global_token_share(self, mask: torch.Tensor, aggregation: str | None = None) -> torch.Tensor | None:
        """For the token mean over every data-parallel rank's completion tokens: their count / the ranks (the
        gradients are averaged over the ranks), so that N processes take the step one process takes; None on one.
        `aggregation`: the loss's (default the policy loss's)."""
        _, ranks = data_parallel_rank_and_size(self.trainer)
        if ranks == 1 or (aggregation or self.grpo.loss_aggregation) != "token_mean":
            return None  # seq_mean: each rank holds as many sequences, the average of their means is the mean
        count = mask.sum()
        torch.distributed.all_reduce(count, group=data_parallel_group(self.trainer.strategy))
        return count / ranks

    def update(self, part: Rollout) -> dict[str, torch.Tensor]:
        """One optimizer update on a share of the rollout: the policy loss."""
        loss, stats = self.policy_objective(part)
        self.step_optimizer(loss)
        return {"loss": loss.detach(), **stats}

    def policy_objective(self, part: Rollout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped policy loss of a share of the rollout, and its statistics (the entropy, the engine's gap)."""
        logprobs, entropy = self.logprobs(part.input_ids, part.targets)
        if part.old_logprobs is None:  # the first update of the rollout: the policy has not moved yet
            part.old_logprobs = logprobs.detach()
        old = part.old_logprobs
        weights, engine_stats = None, {}
        if part.engine_logprobs is not None:
            gap = (old - part.engine_logprobs).abs() * part.mask  # the trainer's vs the engine's, same policy
            engine_stats = {"engine_logprob_gap": gap.sum() / part.mask.sum().clamp(min=1), "engine_gap_max": gap.max()}
            if self.rollout_settings.tis_cap is not None:
                weights = truncated_importance_weights(old, part.engine_logprobs, self.rollout_settings.tis_cap)
                engine_stats["tis_weight"] = (weights * part.mask).sum() / part.mask.sum().clamp(min=1)
        loss, stats = policy_loss(
            logprobs,
            old,
            part.advantages,
            part.mask,
            self.grpo.eps_clip,
            self.grpo.eps_clip_high,
            self.grpo.loss_aggregation,
            num_tokens=self.global_token_share(part.mask),
            kl_coef=self.grpo.kl_coef,
            ref_logprobs=self.reference_logprobs(part.input_ids, part.targets) if self.grpo.kl_coef else None,
            token_weights=weights,
            eps_clip_c=self.grpo.eps_clip_c,
        )
        entropy = (entropy * part.mask).sum() / part.mask.sum().clamp(min=1)
        return loss, {"entropy": entropy, **stats, **engine_stats}

    def policy_optimizer(self):
        """The policy's optimizer (Lightning's wrapper: each of its steps is a global step) and its LR schedule: the
        module's only ones, or the first of several (PPO's critic has its own)."""
        optimizers, schedulers = self.optimizers(), self.lr_schedulers()
        if isinstance(optimizers, list):
            return optimizers[0], schedulers[0]
        return optimizers, schedulers

    def step_optimizer(self, loss: torch.Tensor) -> None:
        """Backward, then the policy's step."""
        self.manual_backward(loss)  # then Lightning's on_after_backward hook
        self.step_policy()

    def step_policy(self) -> None:
        """The policy's gradients clipped, one optimizer step and its LR schedule."""
        optimizer, scheduler = self.policy_optimizer()
        if self.gradient_clip_val:
            self.configure_gradient_clipping(optimizer, self.gradient_clip_val, "norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        _, ranks = data_parallel_rank_and_size(self.trainer)
        try:
            if self.worker.uses_engine and self.worker.engine_step != self.trainer.global_step:
                self.push_weights()
            rollout = self.rollout(batch)
        except RolloutEngineError as error:
            raise self.checkpointed(error) from None
        self.prompts_drawn += len(batch["prompt_ids"]) * ranks
        if self.grpo.dynamic_temperature.enabled:
            self.dynamic_temperature.drawn.append(self.rank_mean(rollout.rewards.float().mean()))
        if self.refill is not None:
            rollout = self.refilled(rollout, len(batch["prompt_ids"]))
            if rollout is None:
                return  # too few varied groups yet: the next rollout batch refills
        started, trained = time.perf_counter(), 0.0
        updates = self.grpo.updates_per_rollout * self.grpo.epochs
        for part in self.minibatches(rollout):
            stats = self.update(part)
            trained += float(part.mask.sum())
            # The schedules advance by the prompt rows of the update, as global_batch_tokens counts them.
            self.tokens_seen += batch["prompt_ids"].numel() * ranks // updates
        seconds = time.perf_counter() - started
        self.prompts_seen, self.prompts_drawn = self.prompts_seen + self.prompts_drawn, 0
        self.dynamic_temperature.at_update()  # as the data position
        self.log("train/loss", stats["loss"], prog_bar=True, sync_dist=True)
        for name in ("clip_fraction", "entropy", "kl", "engine_logprob_gap", "tis_weight"):  # PPO's warm-up: none
            if name in stats:
                self.log(f"rl/{name}", stats[name], sync_dist=True)
        if "engine_gap_max" in stats:
            self.log("rl/engine_logprob_gap_max", stats["engine_gap_max"], sync_dist=True, reduce_fx="max")
        self.adjust_temperature()
        self.log("rl/temperature", self.temperature)
        self.log("optim/lr", self.policy_optimizer()[0].param_groups[0]["lr"])
        self.log("train/tokens_seen", float(self.tokens_seen))
        self.log("perf/train_tokens_per_sec", trained / seconds, sync_dist=True, reduce_fx="sum")

    # -- dynamic temperature
    def rank_mean(self, value: torch.Tensor) -> float:
        """A scalar's mean over the data-parallel ranks."""
        if data_parallel_rank_and_size(self.trainer)[1] > 1:
            value = value.clone()
            group = data_parallel_group(self.trainer.strategy)
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.AVG, group=group)
        return float(value)

    def adjust_temperature(self) -> None:
        """At a plateau of the mean reward, the highest candidate temperature whose held-out accuracy stays within
        max_drop of the current one's (glm46.rl.dynamic_temperature)."""
        prompts = self.grpo.dynamic_temperature.prompts
        accuracies = self.dynamic_temperature.adjust(lambda t: self.held_out_accuracy(t, prompts))
        if accuracies is not None:
            log.info(
                f"step {self.global_step}: mean reward plateaued; held-out accuracy by temperature "
                + ", ".join(f"{t:g}: {a:.3f}" for t, a in accuracies.items())
                + f" -> temperature {self.temperature:g}"
            )

    @torch.no_grad()
    def held_out_accuracy(self, temperature: float, prompts: int) -> float:
        """The verifier's mean reward on the first `prompts` held-out prompts (validation's), one completion each at
        `temperature`, the i-th seeded by i alone: each temperature draws with the same random numbers."""
        rewards, done = [], 0
        for batch in self.trainer.datamodule.val_dataloader():
            batch = {key: value[: prompts - done].to(self.device) for key, value in batch.items()}
            seeds = range(done, done + len(batch["answer"]))
            generators = [torch.Generator(self.device).manual_seed(completion_seed(self.seed, i, 0)) for i in seeds]
            rewards.append(self.worker.verified(batch, temperature, generators))
            done += len(batch["answer"])
            if done >= prompts:
                break
        return self.rank_mean(torch.cat(rewards).float().mean())

    # -- held-out prompts: greedy accuracy
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        worker = self.worker
        if self.grpo.max_turns > 1:  # tool calls served, as in training
            self.val_rewards.append(worker.verified(batch, 0.0, None))
            return
        prompt_lengths, completions, lengths = worker.sample(batch, 1, 0.0, None)
        self.val_rewards.append(worker.rewards(completions, lengths, worker.records(batch)))
        if self.monitor is not None or self.mixed_reward.model is not None:
            input_ids, _, mask = worker.layout(batch, prompt_lengths, completions, lengths)
            if self.monitor is not None:
                self.val_watched["monitor"].append(monitor_scores(self.monitor, self.tokenizer, input_ids, mask))
            if self.mixed_reward.model is not None:
                scores = self.mixed_reward.model.score(input_ids, row_lengths(mask))
                self.val_watched["rm_reward"].append(self.mixed_reward.model.normalized(scores).cpu())

    def on_validation_epoch_end(self) -> None:
        rewards = torch.cat(self.val_rewards) if self.val_rewards else torch.zeros(0)
        self.val_rewards = []
        accuracy = rewards.float().mean() if len(rewards) else torch.tensor(0.0)
        self.log("val/accuracy", accuracy, prog_bar=True, sync_dist=True)
        for name, values in self.val_watched.items():  # the monitor and the reward model on the greedy replies
            if values:
                self.log(f"val/{name}", torch.cat(values).mean().to(self.device), sync_dist=True)
                values.clear()

    # -- checkpoint
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["rl"] = {"prompts_seen": self.prompts_seen, **self.dynamic_temperature.state_dict()}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.prompts_seen = checkpoint["rl"]["prompts_seen"]
        self.dynamic_temperature.load_state_dict(checkpoint["rl"], self.grpo.temperature)  # older checkpoints: none
