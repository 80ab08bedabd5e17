"""GRPO with rollouts from vLLM (phase.rollout.engine=vllm, glm46.rl.engine): the engine's log-probs equal the
trainer's before any update (single completions, and multi-turn episodes' turns on the model's tokens), the reward
rises on test_grpo's easy task with the weights pushed after each update, and an engine that cannot start or dies
ends the run with a clear error (and a checkpoint), never a hang. Marker `serving`: vLLM's CPU build in the serving
venv (scripts/serving_venv.sh)."""

import csv
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from glm46.checkpoint.hf_write import save_hf
from glm46.data.tools import ToolEnvironment
from glm46.peft import AdapterSettings, is_adapter_name
from glm46.rl.engine import RolloutEngineError, RolloutSettings, VLLMRolloutEngine
from glm46.rl.episodes import episode_rows, run_episodes
from glm46.rl.rewards import verify
from glm46.rl.turns import EngineTurns

from .test_grpo import dataset, fit, module  # noqa: F401 (dataset: the module-scoped fixture)
from .test_serving import require_serving

# fp32 on both sides: the engine's kernels (its attention, its fused experts) sum in another order than ours.
# Measured: at most 2e-6 per token on the tiny model (mean 4e-7).
LOGPROB_TOLERANCE = 1e-4


def vllm_settings(**overrides) -> RolloutSettings:
    return RolloutSettings(engine="vllm", **({"kv_cache_gib": 1, "start_timeout_s": 600} | overrides))


def metrics(root) -> list[dict]:
    with open(root / "metrics.csv") as f:
        return list(csv.DictReader(f))


def column(rows: list[dict], key: str) -> list[float]:
    return [float(row[key]) for row in rows if row.get(key)]


@pytest.mark.serving
@pytest.mark.slow
def test_the_engines_logprobs_equal_the_trainers_before_an_update(dataset, tmp_path):  # noqa: F811
    require_serving()
    grpo = module(dataset, max_new_tokens=12)
    export = save_hf(grpo.model, tmp_path / "policy", tokenizer=grpo.tokenizer)
    engine = VLLMRolloutEngine(vllm_settings(), export, tmp_path / "engine.log", "float32")
    try:
        prompt = grpo.tokenizer.encode("<|user|>What is 3 + 4?<|assistant|>")
        answer = engine.generate([prompt] * 4, [7, 8, 9, 7], 1.0, 12, grpo.worker.stop_ids)
        # multi-turn episodes' turns from the engine (glm46.rl.turns.EngineTurns): its log-probs land on the model's
        # tokens of the training rows, where the trainer's equal them
        grpo.worker.engine = engine
        turns = EngineTurns(grpo.worker, seeds=[7, 8, 9], temperature=1.0)
        environments = [ToolEnvironment()] * 3
        played = run_episodes([prompt] * 3, [{"answer": 7}] * 3, turns, grpo.tokenizer, verify, environments, 2, 12)
        sockets = list(Path(engine.ipc.name).iterdir())  # vLLM's ZMQ sockets, in the engine's own folder
    finally:
        engine.close()
    assert sockets and not Path(engine.ipc.name).exists(), "the engine's sockets go with it, never left in /tmp"
    input_ids, targets, mask, episode_logprobs = episode_rows(played, grpo.worker.pad_id)
    with torch.no_grad():
        ours = grpo.logprobs(input_ids, targets)[0]
    assert mask.sum() > 0 and ((ours - episode_logprobs).abs() * mask).max() < LOGPROB_TOLERANCE
    completions = answer["completions"]
    assert completions[0] == completions[3] and completions[0] != completions[1]  # a completion's seed decides it
    for tokens, engine_logprobs in zip(completions, answer["logprobs"]):
        ids = torch.tensor([prompt + tokens])
        targets = torch.full_like(ids, -100)
        targets[0, len(prompt) - 1 : -1] = torch.tensor(tokens)
        with torch.no_grad():
            trainer_logprobs = grpo.logprobs(ids, targets)[0][0, len(prompt) - 1 : -1]
        gap = (trainer_logprobs - torch.tensor(engine_logprobs)).abs().max().item()
        assert gap < LOGPROB_TOLERANCE, (gap, tokens)


@pytest.mark.serving
@pytest.mark.slow
def test_grpo_with_vllm_rollouts_raises_the_reward_on_an_easy_task(dataset, tmp_path):  # noqa: F811
    require_serving()
    fit(module(dataset, rollout=vllm_settings()), dataset, tmp_path, max_steps=30)
    rows = metrics(tmp_path)
    rewards = column(rows, "rl/reward_mean")
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.5 and last > first + 0.3, rewards
    assert len(column(rows, "perf/weight_push_s")) == len(rewards)  # the new weights reached every rollout
    assert max(column(rows, "rl/engine_logprob_gap_max")) < LOGPROB_TOLERANCE  # after the updates too
    assert all(abs(w - 1) < 1e-3 for w in column(rows, "rl/tis_weight"))
    assert [p.name for p in (tmp_path / "rollout").iterdir()] == ["engine.log"]  # pushed weights removed at the end


@pytest.mark.serving
@pytest.mark.slow
def test_grpo_with_lora_pushes_the_merged_weights_the_engine_then_scores_as_the_trainer(dataset, tmp_path):  # noqa: F811
    """Under LoRA the engine gets the merged weights after each update (slime's merge before the sync): its log-probs
    equal the adapted trainer's once the adapters have moved, and the base never moves (the reward rising under LoRA:
    tests/test_grpo.py, with the model's own generate)."""
    require_serving()
    policy = module(dataset, rollout=vllm_settings(), peft=AdapterSettings(r=8, alpha=16, lr=3e-2))
    before = {name: t.clone() for name, t in policy.model.state_dict().items() if not is_adapter_name(name)}
    fit(policy, dataset, tmp_path, max_steps=6)
    after = policy.model.state_dict()
    assert [name for name, t in before.items() if not torch.equal(after[name], t)] == []
    assert all(t.abs().sum() > 0 for name, t in after.items() if name.endswith("lora_B")), "the adapters did not move"
    rows = metrics(tmp_path)
    assert len(column(rows, "perf/weight_push_s")) == len(column(rows, "rl/reward_mean"))  # merged, after each update
    assert max(column(rows, "rl/engine_logprob_gap_max")) < LOGPROB_TOLERANCE


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs (Linux /proc)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    found = [int(c) for c in children.read_text().split()] if children.exists() else []
    return found + [d for child in found for d in descendants(child)]


def running(pids: list[int], wait_s: float) -> list[int]:
    """Those of `pids` still running (not exited, not a zombie) after waiting up to wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = [
            p
            for p in pids
            if Path(f"/proc/{p}/stat").exists() and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z"
        ]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


class KillEngineAt(L.Callback):
    """Kills the rollout engine's process after `step` steps, as a crash of the engine would."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.started = descendants(pl_module.worker.engine.process.pid)  # vLLM's engine core and workers
            pl_module.worker.engine.process.kill()  # the script only, as a crash would: what it started lives on


@pytest.mark.serving
@pytest.mark.slow
def test_an_engine_that_dies_ends_the_run_with_an_error_and_a_checkpoint(dataset, tmp_path):  # noqa: F811
    require_serving()
    killer = KillEngineAt(2)
    with pytest.raises(RolloutEngineError) as error:
        fit(module(dataset, rollout=vllm_settings()), dataset, tmp_path, max_steps=5, callbacks=[killer])
    message = str(error.value)
    assert "exited with code -9 during a weight reload" in message and "engine.log" in message, message
    assert killer.started and not running(killer.started, wait_s=15)  # the engine's processes killed, none orphaned
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    assert "ckpt_path=last" in message and checkpoint.is_file()
    assert torch.load(checkpoint, weights_only=False)["global_step"] == 2


def test_an_engine_that_cannot_start_fails_at_once_naming_its_log(dataset, tmp_path):  # noqa: F811
    # The training environment's python has no vLLM: the engine exits at import.
    settings = vllm_settings(python=sys.executable)
    with pytest.raises(RolloutEngineError) as error:
        fit(module(dataset, rollout=settings), dataset, tmp_path, max_steps=2)
    message = str(error.value)
    assert "exited with code 1 during its start" in message and "No module named 'vllm'" in message, message
    assert (tmp_path / "rollout" / "engine.log").is_file() and (tmp_path / "checkpoints" / "last.ckpt").is_file()
