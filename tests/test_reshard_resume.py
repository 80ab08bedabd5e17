"""A run continues from its checkpoint under another layout or world size, through `python run.py ... ckpt_path=last`
in its run directory: fsdp2 on 4 processes -> fsdp2_ep on 2 (DCP resharded, the global batch kept by gradient
accumulation), single -> fsdp2 on 2 -> single (one file into shards, a DCP folder read whole), and 2 pipeline
stages -> fsdp2 on 2 (a checkpoint of stages read without them). Each
interrupted-and-resharded run trains on exactly the samples of the uninterrupted run, step by step, with its
losses within 1e-5 relative (fp32, Muon with fp32 Newton-Schulz, AdamW eps 1e-5 as in tests/test_parallel.py).
Every run starts from the same HF weights (init_from), so the uninterrupted one-process run is the reference of
every chain. A DeepSpeed checkpoint under a mesh layout, and a DCP folder under DeepSpeed, are refused before
training, naming both layouts and init_from; so is a resume with another global batch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from . import forked
from .helpers import launcher_env

ROOT = Path(__file__).resolve().parents[1]
STEPS, TOLERANCE = 6, 1e-5
RUN = [
    "experiment=tiny_bytes",
    "data.max_bytes=100000",
    "data.seq_len=32",
    f"trainer.max_steps={STEPS}",
    "trainer.val_check_interval=1000",
    "trainer.limit_val_batches=0",
    "callbacks.progress_bar=null",
    "callbacks.throughput=null",
    "callbacks.model_checkpoint.every_n_train_steps=1000",  # last.ckpt only, written on the signal
    "optim.optimizer.eps=1e-5",  # see tests/test_parallel.py: EPS
]


class RecordSteps(L.Callback):
    """Rank 0 appends one JSON line per optimizer step to `path`: the step, its loss averaged over the global batch
    and the global batch's samples (the token rows of every micro-batch on every rank, sorted)."""

    def __init__(self, path: str):
        self.path, self.loss, self.rows, self.step = Path(path), 0.0, [], None

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.loss += float(outputs["loss"])  # divided by the accumulation: the sum is the step's mean
        from glm46.parallel import data_parallel_group

        rows = trainer.strategy.all_gather(batch["input_ids"], group=data_parallel_group(trainer.strategy))
        self.rows += rows.reshape(-1, rows.shape[-1]).tolist()
        if trainer.global_step == self.step:
            return  # inside an accumulation cycle
        self.step = trainer.global_step
        loss = float(trainer.strategy.reduce(torch.tensor(self.loss), reduce_op="mean"))
        if trainer.is_global_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": self.step, "loss": loss, "samples": sorted(self.rows)}) + "\n")
        self.loss, self.rows = 0.0, []


def run(run_dir: Path, record: Path, *overrides: str, init_from: Path, fails: bool = False):
    env = launcher_env()
    callback = [f"+callbacks.record._target_={__name__}.RecordSteps", f"+callbacks.record.path={record}"]
    command = [sys.executable, "run.py", *RUN, f"hydra.run.dir={run_dir}", f"init_from={init_from}", *callback]
    devices = next((int(o.split("=")[1]) for o in overrides if o.startswith("cluster.devices=")), 1)
    # Several processes: each rank forked as srun or torchrun starts them (Lightning launches none of its own)
    result = forked.run_ranks([*command, *overrides], devices, cwd=ROOT, env=env, timeout=600)
    assert (result.returncode != 0) == fails, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def interrupted_after(step: int) -> list[str]:
    """SIGTERM on every rank during step `step` + 1: Preemption saves last.ckpt after that step and stops."""
    return ["+callbacks.signal._target_=tests.helpers.SignalAtStep", f"+callbacks.signal.step={step}"]


# A resume restores the run directory's overrides (glm46.config.restore): it states the layout it continues under
# and leaves out the interruption.
ONE_PROCESS = ["parallelism=single", "cluster.devices=1"]
UNINTERRUPTED = ["~callbacks.signal"]


def steps(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def assert_same_run(record: Path, straight: Path) -> float:
    """Step by step the same samples and losses within TOLERANCE; returns the largest relative loss difference."""
    got, expected = steps(record), steps(straight)
    assert [s["step"] for s in got] == [s["step"] for s in expected] == list(range(1, STEPS + 1))
    worst = 0.0
    for a, b in zip(got, expected):
        assert a["samples"] == b["samples"], f"step {a['step']}: other samples than the uninterrupted run's"
        worst = max(worst, abs(a["loss"] - b["loss"]) / abs(b["loss"]))
        assert abs(a["loss"] - b["loss"]) <= TOLERANCE * abs(b["loss"]), f"step {a['step']}: {a['loss']} vs {b['loss']}"
    print(f"largest relative loss difference: {worst:.2e}")
    return worst


def assert_same_optimizer_state(folder: Path, file: Path) -> None:
    """Muon momentum and AdamW moments of a DCP folder (read whole) equal those of the one-process run's file at the
    same step, parameter by parameter, within TOLERANCE."""
    from glm46.checkpoint.reshard import consolidate

    sharded = consolidate(folder)["optimizer_states"][0]["state"]
    reference = torch.load(file, weights_only=False)["optimizer_states"][0]["state"]
    assert sharded.keys() == reference.keys()
    for name, state in reference.items():
        assert state.keys() == sharded[name].keys(), name
        for key, b in state.items():
            a = sharded[name][key]
            error = ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()
            assert error <= TOLERANCE, f"{name} {key}: relative difference {error:.2e}"


@pytest.fixture(scope="module")
def initial(tmp_path_factory) -> Path:
    """The tiny model's weights at its own initialisation, as an HF directory every run starts from (the random
    init depends on the layout; see README, Starting a model that fits on no rank)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from glm46.config.checks import model_config
    from glm46.config.schema import register_configs
    from glm46.hf import save_hf
    from glm46.modules import GLM46ForCausalLM

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        config = model_config(compose(config_name="config", overrides=["experiment=tiny_bytes"]))
    GlobalHydra.instance().clear()
    torch.manual_seed(0)
    return save_hf(GLM46ForCausalLM(config), tmp_path_factory.mktemp("initial") / "hf")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, initial) -> Path:
    """The uninterrupted run: one process, 4 sequences per step, a checkpoint file every 2 steps."""
    run_dir = tmp_path_factory.mktemp("straight")
    every_2 = "callbacks.model_checkpoint.every_n_train_steps=2"
    run(run_dir, run_dir / "steps.jsonl", "data.batch_size=4", every_2, init_from=initial)
    return run_dir / "steps.jsonl"


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_on_4_processes_continues_as_fsdp2_ep_on_2_with_the_same_samples_and_losses(tmp_path, initial, straight):
    """4 ranks x 1 sequence, interrupted after step 3 (a DCP folder of 4 shards), continued on 2 ranks x 1 sequence
    x accumulation 2: the first step after the resume sums a whole accumulation cycle although 3 is odd."""
    record = tmp_path / "steps.jsonl"
    first = ["parallelism=fsdp2", "cluster.devices=4", "data.batch_size=1"]
    run(tmp_path, record, *first, *interrupted_after(2), init_from=initial)
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert len(list(last.glob("*.distcp"))) == 4 and not (tmp_path / "hf").exists()
    assert torch.load(last / "meta.pt", weights_only=False)["layout"]["parallelism"] == "fsdp2"
    then = ["parallelism=fsdp2_ep", "cluster.devices=2", "data.batch_size=1", "trainer.accumulate_grad_batches=2"]
    run(tmp_path, record, *then, "ckpt_path=last", *UNINTERRUPTED, init_from=initial)
    assert_same_run(record, straight)
    assert (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.distributed
def test_single_continues_as_fsdp2_on_2_processes_and_back_with_the_same_samples_and_losses(
    tmp_path, initial, straight
):
    """One process for steps 1-2 (a one-file checkpoint, Muon/AdamW state keyed by name), fsdp2 on 2 x 2 sequences
    for steps 3-4 (the file broadcast into the shards; a DCP folder), one process again for steps 5-6 (the folder
    read whole; its next last.ckpt, a file, replaces the folder)."""
    record = tmp_path / "steps.jsonl"
    run(tmp_path, record, "data.batch_size=4", *interrupted_after(1), init_from=initial)
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["optimizer_states"][0]
    assert all(isinstance(key, str) for key in state["state"])
    mesh = ["parallelism=fsdp2", "cluster.devices=2", "data.batch_size=2", "ckpt_path=last"]
    run(tmp_path, record, *mesh, *interrupted_after(3), init_from=initial)
    reference = straight.parent / "checkpoints" / "step0000004.ckpt"
    assert_same_optimizer_state(tmp_path / "checkpoints" / "last.ckpt", reference)
    run(tmp_path, record, *ONE_PROCESS, "data.batch_size=4", "ckpt_path=last", *UNINTERRUPTED, init_from=initial)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert_same_run(record, straight)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_pipeline_stages_continue_as_fsdp2_with_the_same_samples_and_losses(tmp_path, initial, straight):
    """parallelism=pp through run.py: 2 stages on 2 processes, each step's 4 sequences in 2 microbatches, interrupted
    after step 3 (each stage's DCP shards), continued under fsdp2 on 2 x 2 sequences: one process's run."""
    record = tmp_path / "steps.jsonl"
    run(
        tmp_path,
        record,
        "parallelism=pp",
        "cluster.devices=2",
        "data.batch_size=4",
        *interrupted_after(2),
        init_from=initial,
    )
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert torch.load(last / "meta.pt", weights_only=False)["layout"]["parallelism"] == "pp"
    run(
        tmp_path,
        record,
        "parallelism=fsdp2",
        "cluster.devices=2",
        "data.batch_size=2",
        "ckpt_path=last",
        *UNINTERRUPTED,
        init_from=initial,
    )
    assert_same_run(record, straight)


def fake_deepspeed_checkpoint(path: Path, processes: int) -> Path:
    """The shape of a DeepSpeed checkpoint folder (`latest`, one ZeRO partition file per rank)."""
    (path / "checkpoint").mkdir(parents=True)
    (path / "latest").write_text("checkpoint")
    for rank in range(processes):
        (path / "checkpoint" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"")
    return path


def assert_refused_before_training(result: subprocess.CompletedProcess, run_dir: Path, *words: str) -> None:
    message = result.stdout + result.stderr
    for word in words:
        assert word in message, message[-3000:]
    assert "Traceback" not in message, message[-3000:]
    assert not (run_dir / "metrics.csv").exists() and not (run_dir / "hf").exists()


@pytest.mark.slow
def test_a_deepspeed_checkpoint_under_fsdp2_is_refused_naming_both_layouts_and_init_from(tmp_path, initial):
    checkpoint = fake_deepspeed_checkpoint(tmp_path / "checkpoints" / "last.ckpt", processes=2)
    result = run(
        tmp_path,
        tmp_path / "steps.jsonl",
        "parallelism=fsdp2",
        "cluster.devices=2",
        "ckpt_path=last",
        init_from=initial,
        fails=True,
    )
    assert_refused_before_training(
        result, tmp_path, "DeepSpeed on 2 processes", "parallelism=fsdp2 on 2 processes", f"init_from={checkpoint}"
    )


@pytest.mark.slow
def test_a_dcp_folder_under_deepspeed_and_another_global_batch_are_refused(tmp_path, initial):
    """The record of a checkpoint folder written by fsdp2 on 4 processes (its meta.pt; the shards do not matter
    before training): DeepSpeed cannot read it; one process with 1 sequence per step instead of 4 is refused too."""
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    checkpoint.mkdir(parents=True)
    (checkpoint / ".metadata").write_bytes(b"")
    layout = {"parallelism": "fsdp2", "world_size": 4, "data_parallel": 4, "global_batch_tokens": 128}
    torch.save({"layout": layout}, checkpoint / "meta.pt")
    deepspeed = ["parallelism=deepspeed_zero3", "optim=adamw", "cluster.devices=2", "data.batch_size=2"]
    result = run(tmp_path, tmp_path / "steps.jsonl", *deepspeed, "ckpt_path=last", init_from=initial, fails=True)
    assert_refused_before_training(
        result,
        tmp_path,
        "distributed checkpoint (DCP) folder written by parallelism=fsdp2 on 4 processes",
        "parallelism=deepspeed_zero3 on 2 processes",
        f"init_from={checkpoint}",
    )
    one = [*ONE_PROCESS, "optim=muon", "data.batch_size=1", "ckpt_path=last"]
    result = run(tmp_path, tmp_path / "steps.jsonl", *one, init_from=initial, fails=True)
    assert_refused_before_training(
        result, tmp_path, "global_batch_tokens=128", "global_batch_tokens=32", "data.batch_size or trainer.accumulate"
    )
