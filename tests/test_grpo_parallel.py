"""GRPO on several processes equals GRPO on one: each data-parallel rank rolls out its share of the step's prompts
(whole groups), the loss's token mean counts every rank's tokens, and sampling is seeded per prompt, so DDP, FSDP2
and expert parallelism (gloo, 2 processes) see the same prompts, draw the same completions and end with the
single-process weights within 1e-5 after 3 steps (fp32, Muon with fp32 Newton-Schulz, gradient clipping). So does
a 2-process run stopped after 2 steps and resumed from its checkpoint, and (marker `serving`) a 2-process run whose
rollouts come from one vLLM engine, against one process with the same engine.

Each run is `main(spec)` on its ranks, started as torchrun or srun starts them (tests.ranks). Every run starts
from the same HF checkpoint through `init_from` (the mesh layouts build the model on the meta device and read their
slices)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

PROMPTS, SAMPLES, STEPS, TOLERANCE = 4, 8, 3, 1e-5
NEW_TOKENS = 16  # long enough for some completions to stop early: the ranks' token counts differ
VOCAB = 400


def main(spec: dict) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from glm46.lit.strategies import build_strategy
    from glm46.optim import Muon
    from glm46.parallel import Layout
    from glm46.parallel.grads import total_grad_norm
    from glm46.parallel.state import full_state_items, is_writer
    from glm46.rl.engine import RolloutSettings
    from glm46.rl.grpo_module import GRPOLitModule
    from glm46.rl.grpo_settings import GRPOSettings
    from glm46.rl.ppo_module import PPOLitModule, PPOSettings
    from glm46.rl.prompts import PromptDataModule
    from tests.helpers import tiny_config
    from tests.test_grpo import starts_with_a_digit
    from tests.test_parallel import compose_layout

    devices = spec["devices"]
    cfg = compose_layout(spec["layout"], [])
    layout = Layout.from_config(cfg.parallelism, devices)
    torch.manual_seed(0)
    algorithm = {}
    if spec.get("ppo"):  # PPO: GRPO's module with a critic (from a reward model) and the KL penalty
        algorithm = {"ppo": PPOSettings(kl_coef=0.05, kl_estimator="k3", critic_init=spec["critic_init"])}
    module = (PPOLitModule if algorithm else GRPOLitModule)(
        tiny_config(vocab_size=VOCAB),
        optimizer=functools.partial(Muon, lr=3e-3, eps=1e-5, ns_dtype=torch.float32),
        lr_schedule=lambda tokens: 1.0,
        mtp_weight=lambda tokens: 0.0,
        empty_init=cfg.parallelism.engine == "mesh",
        init_from=spec["init_from"],
        tokenizer_path=str(Path(spec["dataset"]) / "tokenizer.json"),
        grpo=GRPOSettings(
            samples_per_prompt=SAMPLES, max_new_tokens=NEW_TOKENS, temperature=1.0, max_turns=spec.get("max_turns", 1)
        ),
        rollout=RolloutSettings(engine=spec.get("engine", "local")),
        reward=starts_with_a_digit,
        gradient_clip_val=1.0,
        seed=0,
        **algorithm,
    )

    class Record(L.Callback):
        """Each step's prompt indices and completion rewards on this rank, and the gradient norm before clipping (the
        gradients' scale, which Muon's update hardly sees: a loss averaged per rank instead of over all ranks'
        tokens changes it, not the weights)."""

        def __init__(self):
            self.indices, self.rewards, self.grad_norms = [], [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.indices += batch["index"].tolist()

        def on_after_backward(self, trainer, pl_module):
            self.grad_norms.append(float(total_grad_norm(pl_module.parameters())))

    record = Record()

    collect = module.worker.collect

    def recorded(batch, temperature):  # single turns or episodes: the rewards of a training step's completions
        result, rewards, stats = collect(batch, temperature)
        if module.training:
            record.rewards.append(sorted(rewards.tolist()))
        return result, rewards, stats

    module.worker.collect = recorded
    data = PromptDataModule(
        spec["dataset"], seq_len=128, batch_size=PROMPTS // devices, mixture={"rl": 1.0}, seed=1, val_windows=8
    )
    max_steps = spec.get("max_steps", STEPS)
    checkpoints = [ModelCheckpoint(Path(spec["out"]) / "checkpoints", save_last=True, every_n_train_steps=max_steps)]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=build_strategy(cfg.parallelism, layout),
        precision="32-true",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[record, *checkpoints],
        default_root_dir=spec["out"],
    )
    trainer.fit(module, datamodule=data, ckpt_path=spec.get("ckpt_path"))
    state = {name: None if t is None else t.clone() for name, t in full_state_items(module.model)}  # whole on rank 0
    critic = {}
    if spec.get("ppo"):
        critic = {f"critic.{n}": None if t is None else t.clone() for n, t in full_state_items(module.critic.backbone)}
        critic["critic.head"] = module.critic.head.weight.detach().clone()
    ranks = [(record.indices, record.rewards)]
    if torch.distributed.is_initialized():
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, (record.indices, record.rewards))
    if is_writer():
        steps = len(ranks[0][1])  # this run's (a resumed run records the steps after its checkpoint)
        rewards_per_step = [sorted(sum((rewards[step] for _, rewards in ranks), [])) for step in range(steps)]
        indices = [indices for indices, _ in ranks]
        result = {"state": state, "rewards": rewards_per_step, "indices": indices, "grad_norms": record.grad_norms}
        result["critic"] = critic
        torch.save(result, Path(spec["out"]) / "result.pt")


def run(tmp_path: Path, layout: str, devices: int, name: str = "", **spec) -> dict:
    from tests.ranks import run_ranks

    out = tmp_path / f"{layout}-{devices}{name}"
    out.mkdir(parents=True, exist_ok=True)
    run_ranks(
        main, {"layout": layout, "devices": devices, "out": str(out), **spec}, world_size=devices, logs=out / "logs"
    )
    return torch.load(out / "result.pt", weights_only=False)


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> dict:
    """The prompts (a prepared chat dataset) and the weights every run starts from."""
    from glm46.data.tokenizer import GLMTokenizer
    from glm46.hf import save_hf
    from tests.helpers import random_model, tiny_config
    from tests.test_rlhf import reward_model_export
    from tests.test_sft import make_chat_dataset

    root = tmp_path_factory.mktemp("grpo-parallel")
    weights = save_hf(random_model(tiny_config(vocab_size=VOCAB), seed=0), root / "hf")
    dataset = make_chat_dataset(root / "data")
    critic = reward_model_export(root / "rm", GLMTokenizer.from_file(dataset / "tokenizer.json"))
    return {"dataset": str(dataset), "init_from": str(weights), "critic_init": str(critic)}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, setting) -> dict:
    return run(tmp_path_factory.mktemp("single"), "single", 1, **setting)


def assert_same_weights(run_: dict, reference: dict) -> None:
    for name, expected in reference["state"].items():
        if expected is None:
            continue
        got = run_["state"][name]
        error = float((got - expected).abs().max() / expected.abs().max().clamp(min=1e-12))
        assert error < TOLERANCE, (name, error)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("layout", "max_turns"), [("ddp", 1), ("fsdp2", 1), ("ep", 2)])
def test_grpo_on_two_processes_equals_one_process(tmp_path, setting, one_process, layout, max_turns):
    """EP with multi-turn episodes (max_turns=2), against one process playing them too: the episode loop steps its
    turns together on every rank (`agree`), and multi-turn rows take two forwards of similar width on each."""
    run_ = run(tmp_path, layout, 2, max_turns=max_turns, **setting)
    reference = one_process if max_turns == 1 else run(tmp_path, "single", 1, "-turns", max_turns=max_turns, **setting)
    # the same prompts: one process's batches are the union of the two ranks' (global sample g on rank g % 2)
    assert sorted(reference["indices"][0]) == sorted(run_["indices"][0] + run_["indices"][1]) == list(range(12))
    assert set(run_["indices"][0]).isdisjoint(run_["indices"][1])
    # the same completions: every step's rewards over the ranks are the single process's
    assert run_["rewards"] == reference["rewards"]
    assert 0 < sum(map(sum, reference["rewards"])) < STEPS * PROMPTS * SAMPLES  # rewards differ: gradients flowed
    assert run_["grad_norms"] == pytest.approx(reference["grad_norms"], rel=TOLERANCE)
    assert_same_weights(run_, reference)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_ppo_on_two_processes_equals_one_process(tmp_path, setting, layout):
    """PPO: the critic (from a reward model's export) laid out as the actor, its head's gradient averaged by hand
    under FSDP2, the advantages whitened over both ranks' tokens, the value loss's token mean over both; the
    reference held whole on each rank for the KL penalty."""
    reference = run(tmp_path, "single", 1, "-ppo", ppo=True, **setting)
    run_ = run(tmp_path, layout, 2, "-ppo", ppo=True, **setting)
    assert run_["rewards"] == reference["rewards"]
    assert run_["grad_norms"] == pytest.approx(reference["grad_norms"], rel=TOLERANCE)
    assert_same_weights(run_, reference)
    assert any(name.startswith("critic.") for name in reference["critic"])
    assert_same_weights({"state": run_["critic"]}, {"state": reference["critic"]})


@pytest.mark.slow
@pytest.mark.distributed
def test_a_resumed_two_process_run_equals_one_process(tmp_path, setting, one_process):
    """2 steps on DDP, a checkpoint, then a new job resumes it for the third step: the third step draws the prompts
    and completions the uninterrupted run drew, and ends with its weights."""
    run(tmp_path, "ddp", 2, "-first", max_steps=2, **setting)
    last = tmp_path / "ddp-2-first" / "checkpoints" / "last.ckpt"
    resumed = run(tmp_path, "ddp", 2, "-resumed", ckpt_path=str(last), **setting)
    assert resumed["rewards"] == one_process["rewards"][2:]
    assert sorted(resumed["indices"][0] + resumed["indices"][1]) == sorted(one_process["indices"][0])[8:]
    assert_same_weights(resumed, one_process)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.serving
def test_grpo_with_vllm_rollouts_on_two_processes_equals_one_process(tmp_path, setting):
    """One engine serves both ranks (the first rank sends every rank's prompts in one request, each completion with
    its own seed): the same completions as one process with the engine, and the same weights."""
    from tests.test_serving import require_serving

    require_serving()
    reference = run(tmp_path, "single", 1, "-vllm", engine="vllm", **setting)
    run_ = run(tmp_path, "ddp", 2, "-vllm", engine="vllm", **setting)
    assert run_["rewards"] == reference["rewards"]
    assert 0 < sum(map(sum, reference["rewards"])) < STEPS * PROMPTS * SAMPLES
    assert_same_weights(run_, reference)
