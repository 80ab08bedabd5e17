"""Learning from preferences on several processes equals one process: a reward model under DDP and FSDP2 (the
head's gradient averaged over the data-parallel ranks by hand under FSDP2), and DPO under DDP (its reference
log-probs shared out over the ranks and gathered) end with the single-process weights after 3 steps (gloo, 2
processes, fp32, Muon with fp32 Newton-Schulz); so does a DPO run stopped after 2 steps and resumed, which reads its
reference from the checkpoint instead of computing it from moved weights.

Each run is `main(spec)` on its ranks (tests.ranks), from the same HF checkpoint through `init_from`."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from glm46.optim import Muon

PAIRS, STEPS, TOLERANCE, VOCAB, SEQ_LEN = 4, 3, 1e-5, 400, 96
# DPO trains only on the few reply tokens of each side: experts that see none of them get gradients of rounding
# noise, which Muon's orthogonalisation scales up to whole updates (7.6e-5 apart after 3 steps); AdamW's eps bounds it
OPTIMIZERS = {
    "reward_model": functools.partial(Muon, lr=3e-3, eps=1e-5, ns_dtype=torch.float32),
    "dpo": functools.partial(torch.optim.AdamW, lr=3e-4, eps=1e-5),
}


def main(spec: dict) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from glm46.lit.preference_data import PreferenceDataModule
    from glm46.lit.strategies import build_strategy
    from glm46.parallel import Layout
    from glm46.parallel.state import full_state_items, is_writer
    from glm46.rl.dpo_module import DPOLitModule
    from glm46.rl.reward_model import RewardModelLitModule
    from tests.helpers import tiny_config
    from tests.test_parallel import compose_layout

    devices = spec["devices"]
    cfg = compose_layout(spec["layout"], [])
    layout = Layout.from_config(cfg.parallelism, devices)
    torch.manual_seed(0)
    common = dict(
        optimizer=OPTIMIZERS[spec["module"]],
        lr_schedule=lambda tokens: 1.0,
        mtp_weight=lambda tokens: 0.0,
        empty_init=cfg.parallelism.engine == "mesh",
        init_from=spec["init_from"],
    )
    if spec["module"] == "reward_model":
        module = RewardModelLitModule(tiny_config(vocab_size=VOCAB), **common, center_coef=0.01)
    else:
        module = DPOLitModule(tiny_config(vocab_size=VOCAB), **common, beta=0.5, reference_batch_size=5)

    class Record(L.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(trainer.callback_metrics["train/loss"]))

    record = Record()
    data = PreferenceDataModule(
        spec["dataset"], seq_len=SEQ_LEN, batch_size=PAIRS // devices, mixture={"preference": 1.0}, seed=1
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
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[record, *checkpoints],
        default_root_dir=spec["out"],
    )
    trainer.fit(module, datamodule=data, ckpt_path=spec.get("ckpt_path"))
    state = {name: None if t is None else t.clone() for name, t in full_state_items(module.model)}
    if spec["module"] == "reward_model":
        state["score.weight"] = module.score.weight.detach().clone()
    if is_writer():
        result = {"state": state, "losses": record.losses, "reference": data.reference}
        torch.save(result, Path(spec["out"]) / "result.pt")


def run(tmp_path: Path, module: str, layout: str, devices: int, name: str = "", **spec) -> dict:
    from tests.ranks import run_ranks

    out = tmp_path / f"{module}-{layout}-{devices}{name}"
    out.mkdir(parents=True, exist_ok=True)
    spec = {"module": module, "layout": layout, "devices": devices, "out": str(out), **spec}
    run_ranks(main, spec, world_size=devices, logs=out / "logs")
    return torch.load(out / "result.pt", weights_only=False)


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> dict:
    """The generated style task's pairs (prepared) and the weights every run starts from."""
    from glm46.data.pipeline import prepare_dataset
    from glm46.data.preference_task import write_task
    from glm46.hf import save_hf
    from tests.helpers import random_model, tiny_config

    root = tmp_path_factory.mktemp("preference-parallel")
    pairs, _ = write_task(root, pairs=80, prompts=0)
    prepare_dataset("preference", [str(pairs)], root / "data", default_domain="preference", vocab_size=VOCAB)
    weights = save_hf(random_model(tiny_config(vocab_size=VOCAB), seed=0), root / "hf")
    return {"dataset": str(root / "data"), "init_from": str(weights)}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, setting) -> dict:
    root = tmp_path_factory.mktemp("single")
    return {module: run(root, module, "single", 1, **setting) for module in ("reward_model", "dpo")}


def assert_same_run(run_: dict, reference: dict) -> None:
    assert run_["losses"] == pytest.approx(reference["losses"], rel=TOLERANCE)
    for name, expected in reference["state"].items():
        if expected is None:
            continue
        error = float((run_["state"][name] - expected).norm() / expected.norm().clamp(min=1e-12))
        assert error < TOLERANCE, (name, error)  # as tests/test_parallel.py: a tensor's norm of differences


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("module", "layout"), [("reward_model", "ddp"), ("reward_model", "fsdp2"), ("dpo", "ddp")])
def test_two_processes_equal_one_process(tmp_path, setting, one_process, module, layout):
    reference = one_process[module]
    assert len(set(reference["losses"])) == STEPS  # the weights moved (each starts at log 2: rewards 0 or ratios 1)
    run_ = run(tmp_path, module, layout, 2, **setting)
    assert_same_run(run_, reference)
    if module == "dpo":  # the reference table gathered from the two ranks' shares is one process's
        assert_same_reference(run_, reference)


def assert_same_reference(run_: dict, reference: dict) -> None:
    for split, domains in reference["reference"].items():
        for domain, table in domains.items():
            assert table.shape[0] > 0
            assert torch.allclose(torch.from_numpy(run_["reference"][split][domain]), torch.from_numpy(table))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_resumed_dpo_run_reads_its_reference_and_equals_one_process(tmp_path, setting, one_process):
    run(tmp_path, "dpo", "ddp", 2, "-first", max_steps=2, **setting)
    last = tmp_path / "dpo-ddp-2-first" / "checkpoints" / "last.ckpt"
    resumed = run(tmp_path, "dpo", "ddp", 2, "-resumed", ckpt_path=str(last), **setting)
    reference = one_process["dpo"]
    assert resumed["losses"] == pytest.approx(reference["losses"][2:], rel=TOLERANCE)
    assert_same_run({**resumed, "losses": reference["losses"]}, reference)
    assert_same_reference(resumed, reference)  # read from the checkpoint, not computed from the moved weights
