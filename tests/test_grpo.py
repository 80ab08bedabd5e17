"""The GRPO stage (glm46.rl.grpo_module.GRPOLitModule) on a tiny model: rollouts laid out right, the reward rises on an
easy task, a resumed run equals an uninterrupted one, and the data position counts data-parallel ranks."""

import itertools
from functools import partial

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from glm46.errors import ConfigError
from glm46.modules.loss import IGNORE_INDEX
from glm46.peft import AdapterSettings, is_adapter_name
from glm46.rl import grpo_module
from glm46.rl.core_algos import token_logprobs, width_groups
from glm46.rl.dynamic_temperature import TemperatureSettings, highest_within, plateaued
from glm46.rl.grpo_module import GRPOLitModule
from glm46.rl.grpo_settings import GRPOSettings
from glm46.rl.prompts import PromptDataModule
from glm46.rl.turns import ModelTurns

from .helpers import tiny_config
from .test_sft import make_chat_dataset

LR = 3e-3


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_chat_dataset(tmp_path_factory.mktemp("grpo"))


def starts_with_a_digit(record, completion: str) -> float:
    """An easy reward a random policy earns now and then: the completion's first character is a digit."""
    return float(completion[:1].isdigit())


def module(dataset, rollout=None, peft=None, **overrides) -> GRPOLitModule:
    """GRPOLitModule with GRPO settings (GRPOSettings fields) overridden by `overrides`, rolling out with `rollout`
    (RolloutSettings; None: the model's generate), with adapters when `peft` (AdapterSettings) says so."""
    settings = dict(samples_per_prompt=8, max_new_tokens=4, temperature=1.0) | overrides
    L.seed_everything(0)
    return GRPOLitModule(
        tiny_config(vocab_size=400),
        optimizer=partial(torch.optim.AdamW, lr=LR),
        lr_schedule=lambda tokens: 1.0,  # a factor of the optimizer's LR
        mtp_weight=lambda tokens: 0.0,
        tokenizer_path=str(dataset / "tokenizer.json"),
        grpo=GRPOSettings(**settings),
        rollout=rollout,
        reward=starts_with_a_digit,
        seed=0,
        peft=peft,
    )


def prompts(dataset, batch_size=4) -> PromptDataModule:
    return PromptDataModule(
        str(dataset), seq_len=128, batch_size=batch_size, mixture={"rl": 1.0}, seed=1, val_windows=8
    )


def fit(model, dataset, root, max_steps, ckpt_path=None, every=None, callbacks=()) -> L.Trainer:
    callbacks = list(callbacks) + (
        [ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=every, save_last=True)] if every else []
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=L.pytorch.loggers.CSVLogger(root, name="", version=""),
        callbacks=callbacks,
        enable_checkpointing=bool(every),
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        limit_val_batches=0,
        default_root_dir=root,
    )
    trainer.fit(model, datamodule=prompts(dataset), ckpt_path=ckpt_path)
    return trainer


def rewards_logged(root, key: str = "rl/reward_mean") -> list[float]:
    import csv

    with open(root / "metrics.csv") as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


def test_rollout_rows_hold_prompt_then_completion_with_targets_on_the_completion_only(dataset):
    model = module(dataset, max_new_tokens=6)
    datamodule = prompts(dataset, batch_size=3)
    datamodule.setup()
    batch = next(iter(datamodule.train_dataloader()))
    prompt_lengths, completions, lengths = model.worker.sample(batch, 2, 1.0, torch.Generator().manual_seed(0))
    input_ids, targets, mask = model.worker.layout(batch, prompt_lengths, completions, lengths)
    for i in range(6):
        p, n = int(prompt_lengths[i]), int(lengths[i])
        assert p == batch["prompt_length"][i // 2]  # rows group by group
        assert torch.equal(input_ids[i, :p], batch["prompt_ids"][i // 2, :p])
        assert torch.equal(input_ids[i, p : p + n], completions[i, :n])
        assert torch.equal(targets[i, p - 1 : p + n - 1], completions[i, :n])  # position t predicts token t + 1
        assert (targets[i, : p - 1] == IGNORE_INDEX).all() and (targets[i, p + n - 1 :] == IGNORE_INDEX).all()
        assert mask[i].sum() == n
        stops = torch.isin(completions[i, :n], torch.tensor(model.worker.stop_ids))
        assert not stops[:-1].any(), "a completion ends at its first stop token"


def test_left_padded_rollouts_equal_each_prompt_sampled_alone(dataset):
    """The batch's prompts have different lengths; greedy completions equal each prompt's own."""
    model = module(dataset, max_new_tokens=5)
    datamodule = prompts(dataset, batch_size=4)
    datamodule.setup()
    batch = next(iter(datamodule.train_dataloader()))
    assert len(set(batch["prompt_length"].tolist())) > 1
    _, together, _ = model.worker.sample(batch, 1, 0.0, None)
    for i in range(4):
        alone = batch["prompt_ids"][i : i + 1, : batch["prompt_length"][i]]
        expected = model.model.generate(alone, 5, eos_token_id=model.worker.stop_ids)[0, alone.shape[1] :]
        assert torch.equal(together[i, : len(expected)], expected)


@pytest.mark.slow
def test_the_reward_rises_on_an_easy_task(dataset, tmp_path):
    fit(module(dataset), dataset, tmp_path, max_steps=30)
    rewards = rewards_logged(tmp_path)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.5 and last > first + 0.3, rewards
    flat = rewards_logged(tmp_path, "rl/flat_groups")  # every group all 0 at a step whose rewards are all 0
    assert all(f == 1 for f, r in zip(flat, rewards) if r == 0) and 0 <= min(flat) < 1, flat


def test_grpo_with_lora_trains_the_adapters_alone_and_the_reward_rises(dataset, tmp_path):
    """The rollouts sample the adapted policy (the adapters act in generate's forwards too); the base never moves."""
    policy = module(dataset, peft=AdapterSettings(r=8, alpha=16, lr=3e-2))
    before = {name: t.clone() for name, t in policy.model.state_dict().items() if not is_adapter_name(name)}
    fit(policy, dataset, tmp_path, max_steps=30)
    rewards = rewards_logged(tmp_path)
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3, rewards
    after = policy.model.state_dict()
    assert [name for name, t in before.items() if not torch.equal(after[name], t)] == []


@pytest.mark.parametrize("updates_per_rollout", [1, 2])
def test_a_resumed_run_equals_an_uninterrupted_one(dataset, tmp_path, updates_per_rollout):
    straight = module(dataset, updates_per_rollout=updates_per_rollout)
    fit(straight, dataset, tmp_path / "straight", max_steps=4 * updates_per_rollout)
    first = module(dataset, updates_per_rollout=updates_per_rollout)
    fit(first, dataset, tmp_path / "resumed", max_steps=2 * updates_per_rollout, every=2 * updates_per_rollout)
    resumed = module(dataset, updates_per_rollout=updates_per_rollout)
    last = tmp_path / "resumed" / "checkpoints" / "last.ckpt"
    fit(resumed, dataset, tmp_path / "resumed", max_steps=4 * updates_per_rollout, ckpt_path=str(last))
    assert resumed.prompts_seen == straight.prompts_seen == 16
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    # the resumed run's rollouts are the uninterrupted run's (sampling is seeded by each prompt's global index)
    assert rewards_logged(tmp_path / "resumed")[-1] == rewards_logged(tmp_path / "straight")[-1]


def test_later_updates_of_a_rollout_compare_against_the_policy_that_sampled(dataset, tmp_path, monkeypatch):
    """updates_per_rollout=2: the second update's old log-probs are the sampling policy's, taken before the first
    update moved it; the first update's are its own (ratio 1), so no forward is spent on them."""
    model = module(dataset, updates_per_rollout=2)
    before, losses, forwards = {}, [], []
    take_minibatches, policy_loss, logprobs = model.minibatches, grpo_module.policy_loss, model.logprobs

    def minibatches(rollout):
        parts = rollout.split(2)
        with torch.no_grad():
            before["logprobs"] = [logprobs(part.input_ids, part.targets)[0] for part in parts]
        before["masks"] = [part.mask.bool() for part in parts]
        yield from take_minibatches(rollout)

    def counted_logprobs(*args):
        forwards.append(len(args[0]))
        return logprobs(*args)

    def recording_policy_loss(logprobs, old, *args, **kwargs):
        losses.append((logprobs.detach(), old))
        return policy_loss(logprobs, old, *args, **kwargs)

    monkeypatch.setattr(model, "minibatches", minibatches)
    monkeypatch.setattr(model, "logprobs", counted_logprobs)
    monkeypatch.setattr(grpo_module, "policy_loss", recording_policy_loss)
    fit(model, dataset, tmp_path, max_steps=2)  # one rollout, two updates
    (first, first_old), (second, second_old) = losses
    assert len(forwards) == 3  # the second share's old log-probs, then each update's own
    (first_before, second_before), (first_mask, second_mask) = before["logprobs"], before["masks"]
    assert torch.equal(first_old, first)
    torch.testing.assert_close(first_old[first_mask], first_before[first_mask])
    torch.testing.assert_close(second_old[second_mask], second_before[second_mask])
    assert (second[second_mask] - second_before[second_mask]).abs().max() > 1e-4  # the first update moved it


def test_a_later_epoch_compares_every_row_against_the_policy_that_sampled_it(dataset, tmp_path, monkeypatch):
    """epochs=2: the second pass (its rows shuffled) takes each row's old log-probs from the first, the first share's
    included (taken at its own update, before the policy moved), not from the policy the first pass moved."""
    model = module(dataset, updates_per_rollout=2, epochs=2)
    olds, update = [], model.update

    def recorded(part):
        stats = update(part)
        olds.append({tuple(r.tolist()): o for r, o in zip(part.input_ids, part.old_logprobs)})
        return stats

    monkeypatch.setattr(model, "update", recorded)
    fit(model, dataset, tmp_path, max_steps=4)  # one rollout: two passes of two updates
    first, second = olds[0] | olds[1], olds[2] | olds[3]
    assert first.keys() == second.keys() and all(torch.equal(first[row], second[row]) for row in first)


def test_the_data_position_counts_prompts_over_data_parallel_ranks(dataset):
    class Trainer:  # what samples_consumed reads: the module's count, not global_step x world_size
        lightning_module = type("M", (), {"prompts_seen": 24})()
        global_step, world_size, accumulate_grad_batches = 3, 4, 1

    datamodule = prompts(dataset)
    datamodule.trainer = Trainer()
    assert datamodule.samples_consumed() == 24


def test_multi_turn_episodes_of_prompts_without_tools_are_the_single_turn_rollouts(dataset, tmp_path):
    """phase.grpo.max_turns > 1 plays episodes (glm46.rl.episodes) with the same generators: a prompt that lists no
    tools gives the single-turn rows, targets and rewards, except where a completion ends in a tool call (which no
    tool serves: the episode goes on); and such a GRPO run trains."""
    model = module(dataset, max_new_tokens=6, max_turns=3)
    datamodule = prompts(dataset, batch_size=3)
    datamodule.setup()
    batch = next(iter(datamodule.train_dataloader()))
    assert not batch["tools"].any()
    single, single_rewards = model.worker.single_turns(batch, model.temperature)
    multi, multi_rewards, _ = model.worker.episodes(batch, model.temperature)
    observation = model.tokenizer.token_id("<|observation|>")
    alike = [i for i in range(len(single_rewards)) if observation not in single.input_ids[i].tolist()]
    assert len(alike) >= len(single_rewards) - 2
    width = single.input_ids.shape[1]
    for i in alike:
        assert torch.equal(multi.input_ids[i, :width], single.input_ids[i])
        assert torch.equal(multi.targets[i, :width], single.targets[i]) and multi_rewards[i] == single_rewards[i]
    fit(module(dataset, max_new_tokens=6, max_turns=2), dataset, tmp_path, max_steps=2)
    logged = rewards_logged(tmp_path, "rl/turns")
    assert logged and all(1 <= turns <= 2 for turns in logged)


def test_max_turn_tokens_bounds_each_turn_of_an_episode(dataset):
    """phase.grpo.max_turn_tokens: a turn that reaches it without a stop token ends its episode, out of tokens, while
    max_new_tokens stays the episode's bound; 0 is refused when the settings are built."""
    model = module(dataset, max_new_tokens=8, max_turns=2, max_turn_tokens=2, temperature=1.0)
    datamodule = prompts(dataset, batch_size=3)
    datamodule.setup()
    batch = next(iter(datamodule.train_dataloader()))
    worker = model.worker
    turns = ModelTurns(model.model, worker.stop_ids, worker.pad_id, model.device, 1.0, worker.generators(batch, 8))
    played = worker.play(batch, 8, turns)
    assert all(len(e.tokens) <= 2 for e in played)
    assert {e.ended for e in played if len(e.tokens) == 2 and e.tokens[-1] not in worker.stop_ids} == {"out_of_tokens"}
    with pytest.raises(ConfigError, match=r"^phase\.grpo\.max_turn_tokens=0 must be >= 1 \(or null\)$"):
        GRPOSettings(max_turn_tokens=0)


def test_rows_of_different_lengths_score_as_one_full_width_forward(dataset):
    """GRPOLitModule.logprobs runs a batch's long and short rows (multi-turn episodes beside single replies) as two
    forwards, each cut after its last target: the same log-probs and gradients as one forward over the padded rows."""
    model = module(dataset, temperature=0.7, max_turns=2)
    torch.manual_seed(0)
    input_ids = torch.randint(0, 400, (6, 40))
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    for row, end in enumerate([40, 12, 38, 9, 10, 25]):  # least padding: 39, 37 and 24 wide, then 11, 9 and 8
        targets[row, end - 6 : end - 1] = input_ids[row, end - 5 : end]
    assert [(sorted(rows.tolist()), width) for rows, width in width_groups(targets)] == [
        ([0, 2, 5], 39),
        ([1, 3, 4], 11),
    ]

    logprobs, entropy = model.logprobs(input_ids, targets)
    logprobs.sum().backward()
    split = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    hidden = model.model.hidden_states(input_ids, torch.arange(40).expand_as(input_ids))
    expected, expected_entropy = token_logprobs(
        hidden, model.model.lm_head.weight, targets, 0.7, model.model.loss_chunk_size, return_entropy=True
    )
    expected.sum().backward()
    whole = [p.grad for p in model.parameters() if p.grad is not None]
    mask = targets != IGNORE_INDEX
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[mask], expected_entropy[mask], atol=1e-5, rtol=1e-5)
    assert len(split) == len(whole) > 0
    for a, b in zip(split, whole):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def scripted(model: GRPOLitModule) -> tuple[list, list]:
    """A scripted policy's rewards: a prompt whose answer is divisible by 3 earns 1, 0, 1, 0, ... over its group (a
    varied group), any other prompt 0 throughout (a flat one). Returns the lists that record each rollout batch drawn
    and each update's rows."""
    drawn, trained = [], []
    rollout, update = model.rollout, model.update

    def rewards(completions, lengths, records):
        answers = torch.tensor([record["answer"] for record in records])
        return ((answers % 3 == 0) & (torch.arange(len(answers)) % 2 == 0)).float()

    def recorded_rollout(batch):
        drawn.append(rollout(batch))
        return drawn[-1]

    def recorded_update(part):
        trained.append(part)
        return update(part)

    model.worker.rewards, model.rollout, model.update = rewards, recorded_rollout, recorded_update
    return drawn, trained


def groups(rollout, size=8) -> list:
    """The rollout's groups, each its rows cut after its widest completion (a refilled batch pads to its widest)."""
    out = []
    for g in range(len(rollout.rewards) // size):
        rows = rollout.select(slice(g * size, (g + 1) * size))
        width = int(torch.nonzero(rows.mask.any(0)).max()) + 2  # the last target's position, then its token
        out.append((rows.input_ids[:, :width], rows.rewards))
    return out


def logged_by_batch(root, key: str) -> dict[int, float]:
    import csv

    with open(root / "metrics.csv") as f:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(f) if row.get(key)}


def test_dynamic_sampling_trains_the_first_varied_groups_drawn_and_counts_every_prompt(dataset, tmp_path):
    """phase.grpo.dynamic_sampling: each update takes 4 groups (a rollout batch's), the first varied ones in the order
    drawn, after as many rollout batches as they need; at max_draws flat groups fill the rest; the data position
    counts every prompt drawn."""
    model = module(dataset, dynamic_sampling=True, max_draws=2)
    drawn, trained = scripted(model)
    fit(model, dataset, tmp_path, max_steps=5)
    expected, varied, flat, draws = [], [], [], []
    for rollout in drawn:  # the refill's rule, replayed on what was drawn
        for group in groups(rollout):
            (flat if bool((group[1] == group[1][0]).all()) else varied).append(group)
        draws.append(rollout)
        if len(varied) >= 4 or len(draws) == 2:
            expected.append(((varied + flat)[:4], len(draws)))
            varied, flat, draws = [], [], []
    assert not draws and len(trained) == len(expected) == 5
    assert sorted({n for _, n in expected}) == [1, 2], "updates after one rollout batch and after max_draws"
    for part, (chosen, _) in zip(trained, expected):
        assert len(part.rewards) == 32
        for (ids, rewards), (want_ids, want_rewards) in zip(groups(part), chosen):
            assert torch.equal(ids, want_ids) and torch.equal(rewards, want_rewards)
    # logged at each update's batch (a batch that only draws repeats the last update's: Lightning keeps step values)
    at_updates = list(itertools.accumulate(n for _, n in expected))
    logged = {key: logged_by_batch(tmp_path, key) for key in ("rl/draws", "rl/filled_flat")}
    assert [logged["rl/draws"][b - 1] for b in at_updates] == [n for _, n in expected]
    filled = [sum(bool((r == r[0]).all()) for _, r in chosen) / 4 for chosen, _ in expected]
    assert [logged["rl/filled_flat"][b - 1] for b in at_updates] == filled and max(filled) > 0
    assert model.prompts_seen == 4 * len(drawn)


def test_dynamic_sampling_stopped_between_draws_resumes_as_the_uninterrupted_run(dataset, tmp_path):
    """Stopped while the refill holds groups (a preemption's checkpoint between updates): the data position is the
    last update's, so the resumed run draws the same groups again and ends with the uninterrupted run's weights."""

    class StopBetweenDraws(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step >= 2 and pl_module.refill.draws and not trainer.should_stop:
                trainer.save_checkpoint(tmp_path / "between.ckpt")
                trainer.should_stop = True

    straight = module(dataset, dynamic_sampling=True, max_draws=3)
    scripted(straight)
    fit(straight, dataset, tmp_path / "straight", max_steps=4)
    first = module(dataset, dynamic_sampling=True, max_draws=3)
    scripted(first)
    fit(first, dataset, tmp_path / "first", max_steps=4, callbacks=[StopBetweenDraws()])
    assert first.trainer.global_step < 4 and first.refill.draws > 0
    resumed = module(dataset, dynamic_sampling=True, max_draws=3)
    scripted(resumed)
    fit(resumed, dataset, tmp_path / "resumed", max_steps=4, ckpt_path=str(tmp_path / "between.ckpt"))
    assert resumed.prompts_seen == straight.prompts_seen
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_plateaus_and_the_highest_temperature_within_the_held_out_bound():
    assert not plateaued([0.1, 0.2, 0.3], window=2, min_gain=0.01)  # fewer than two windows
    assert plateaued([0.1, 0.3, 0.2, 0.205], window=2, min_gain=0.01)  # 0.2025 after 0.2
    assert not plateaued([0.1, 0.3, 0.3, 0.3], window=2, min_gain=0.01)  # 0.3 after 0.2
    accuracies = {0.7: 0.50, 0.8: 0.49, 1.0: 0.47, 1.2: 0.52}
    assert highest_within(accuracies, 0.7, max_drop=0.05) == 1.2  # 0.52 >= 0.475
    assert highest_within(accuracies | {1.2: 0.30}, 0.7, max_drop=0.05) == 0.8  # 1.0's 0.47 falls 6%
    assert highest_within({0.7: 0.0, 1.0: 0.0}, 0.7, max_drop=0.01) == 1.0  # nothing to lose
    for bad, key in (({"window": 0}, "window=0"), ({"max_drop": 1.0}, "max_drop=1.0"),
                     ({"candidates": [1.0, 0.8]}, r"candidates=\[1\.0, 0\.8\]")):  # fmt: skip
        with pytest.raises(ConfigError, match=rf"^phase\.grpo\.dynamic_temperature\.{key}"):
            TemperatureSettings(**bad)


def test_dynamic_temperature_rises_at_a_plateau_and_resumes_with_its_history(dataset, tmp_path):
    """A scripted policy whose rewards are flat from the start: after two windows of two rollout batches the held-out
    accuracies (scripted too) are probed at the current and each higher candidate, the highest within max_drop of the
    current's is taken, and the next rollouts sample at it. Stopped after 3 updates and resumed, the run probes at the
    same update: the history of rewards is in the checkpoint."""
    settings = TemperatureSettings(enabled=True, window=2, candidates=[0.8, 1.0, 1.2], max_drop=0.05, prompts=4)
    accuracy = {0.7: 0.50, 0.8: 0.49, 1.0: 0.47, 1.2: 0.30}  # within 5% of 0.50: 0.8, not 1.0

    def scripted_run(root, max_steps, ckpt_path=None, every=None):
        model = module(dataset, temperature=0.7, dynamic_temperature=settings)
        probed, sampled, sample = [], [], model.worker.sample
        model.worker.rewards = lambda completions, lengths, answers: torch.zeros(len(answers))

        def held_out_accuracy(temperature, prompts):
            probed.append((model.global_step, temperature, prompts))
            return accuracy[temperature]

        def recorded_sample(batch, samples, temperature, generator):
            sampled.append(temperature)
            return sample(batch, samples, temperature, generator)

        model.held_out_accuracy, model.worker.sample = held_out_accuracy, recorded_sample
        fit(model, dataset, root, max_steps, ckpt_path=ckpt_path, every=every)
        return model, probed, sampled

    straight, probed, sampled = scripted_run(tmp_path / "straight", 6)
    assert probed == [(4, t, 4) for t in (0.7, 0.8, 1.0, 1.2)]
    assert sampled == [0.7] * 4 + [0.8] * 2 and straight.temperature == 0.8
    logged = logged_by_batch(tmp_path / "straight", "rl/temperature")  # float32 in the logs
    assert logged == pytest.approx(dict(enumerate([0.7] * 3 + [0.8] * 3)))
    scripted_run(tmp_path / "resumed", 3, every=3)
    resumed, probed, sampled = scripted_run(
        tmp_path / "resumed", 6, ckpt_path=str(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    )
    assert probed == [(4, t, 4) for t in (0.7, 0.8, 1.0, 1.2)] and sampled == [0.7, 0.8, 0.8]


def test_held_out_accuracy_samples_the_first_held_out_prompts_alike_at_every_temperature(dataset, tmp_path):
    model = module(dataset)
    fit(model, dataset, tmp_path, max_steps=1)
    seen, verified = [], model.worker.verified

    def counted(batch, temperature, generators):
        seen.append((len(batch["answer"]), [g.initial_seed() for g in generators]))
        return verified(batch, temperature, generators)

    model.worker.verified, model.worker.reward = counted, lambda record, text: float(len(text) % 2 == 0)  # about half
    first, again = model.held_out_accuracy(1.0, 10), model.held_out_accuracy(1.0, 10)
    model.held_out_accuracy(1.5, 10)
    model.held_out_accuracy(1.0, 3)
    assert first == again and 0 < first < 1
    assert [n for n, _ in seen] == [4, 4, 4, 3]  # every held-out prompt (4 here), or the first 3
    assert seen[0] == seen[1] == seen[2] and seen[3][1] == seen[0][1][:3]  # the same seeds at every temperature
