"""Launching: a cluster config renders the batch script a cluster user expects, validation refuses a job
that cannot run before anything is queued, and jobs, sweeps and requeues run on the real local Slurm."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate

from glm46.config.checks import validate
from glm46.config.schema import register_configs
from glm46.errors import ConfigError
from glm46.optim.schedules import LinearRamp, steps_for

from . import forked
from .conftest import CONF_DIR
from .slurm import require_slurm, sacct_states

REPO = Path(__file__).resolve().parents[1]
# Short local jobs: no validation, few checkpoints, the tiny model on the standard library's bytes.
QUICK = [  # micro-batches of 2 x 32 tokens: what these tests check is the job's course, not what it learns
    "experiment=tiny_bytes",
    "data.max_bytes=200000",
    "data.seq_len=32",
    "data.batch_size=2",
    "trainer.val_check_interval=1000",
    "trainer.limit_val_batches=0",
    "logger=csv",
]


def compose_with_hydra(*overrides: str):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    GlobalHydra.instance().clear()
    HydraConfig.instance().set_config(cfg)
    return cfg


def test_h800_composition_renders_the_production_batch_script(tmp_path):
    cfg = compose_with_hydra(
        "experiment=pretrain_phase1", "cluster=h800_1024n", "data.path=/data", f"hydra.sweep.dir={tmp_path}"
    )
    assert cfg.hydra.mode.name == "MULTIRUN"  # naming the cluster is enough to submit
    assert (cfg.trainer.num_nodes, cfg.trainer.devices, cfg.trainer.accelerator) == (1024, 8, "gpu")
    script = instantiate(cfg.hydra.launcher).executor()._executor._make_submission_file_text("python -m x", "uid")
    for line in [
        "#SBATCH --nodes=1024",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=h800",
        "#SBATCH --time=4320",
        "#SBATCH --requeue",
        "#SBATCH --exclusive",
        "#SBATCH --signal=USR1@600",
        "export NCCL_IB_HCA=mlx5",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
    ]:
        assert line in script.splitlines(), line
    assert "USR2" not in script  # submitit's own signal is replaced: the Preemption callback owns requeue
    (srun,) = [line for line in script.splitlines() if line.startswith("srun ")]
    assert "--kill-on-bad-exit=1" in srun.split()  # one task exiting non-zero ends the others: no hang
    # 64M tokens per step over 64 data-parallel ranks (TP 8 x PP 16) of 16 x 4096 tokens: 16 accumulated batches.
    assert cfg.trainer.accumulate_grad_batches == 16
    # 15T tokens: 64M per step after the batch-size warm-up (16M -> 64M over 500B), its smaller steps counted
    ramp = LinearRamp(start=16 * 2**20, end=64 * 2**20, ramp_tokens=500 * 10**9)
    assert cfg.trainer.max_steps == steps_for(15 * 10**12, ramp, 0, 4 * 2**20, 16) == 229_894
    validate(cfg)  # the production layout fits: accepted


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["experiment=pretrain_phase1", "cluster=h100_8n", "data.path=/data"],
            "world size 64 (cluster.num_nodes x cluster.devices) must be divisible by tensor_parallel x "
            "pipeline_parallel = 8 x 16",
        ),
        (["experiment=pretrain_phase1", "cluster=h800_1024n", "data.path=/data", "parallelism=fsdp2"], "does not fit"),
        (
            ["experiment=pretrain_phase1", "cluster=h800_1024n", "data.path=/data", "data.batch_size=48"],
            "phase.global_batch_tokens=67108864 is not divisible by data.batch_size x data.seq_len x "
            "data-parallel ranks",
        ),
        (["cluster=local_slurm", "cluster.partition=null"], "cluster.partition is not set"),
        (["cluster=local_slurm", "cluster.devices=2"], "parallelism=single runs one process"),
    ],
)
def test_validation_refuses_jobs_that_cannot_run(overrides, message):
    cfg = compose_with_hydra(*overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(cfg)


def test_a_missing_mandatory_value_is_refused_before_sbatch(tmp_path):
    """`???` values (here data.path) are refused by the launcher's check, naming the key; nothing is queued."""
    result = forked.run(
        [
            sys.executable,
            str(REPO / "run.py"),
            "experiment=pretrain_phase1",
            "cluster=h800_1024n",
            f"paths.sweep_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "data.path: no value (???) for task=train; set data.path=..." in result.stderr
    assert not (tmp_path / "train" / ".submitit").exists()


def test_a_refused_job_is_never_submitted(tmp_path):
    """The launcher validates before it calls sbatch: with no Slurm answering, the refusal is all we see."""
    result = forked.run(
        [
            sys.executable,
            str(REPO / "run.py"),
            "experiment=pretrain_phase1",
            "cluster=h100_8n",
            "data.path=/data",
            f"paths.sweep_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "tensor_parallel x pipeline_parallel = 8 x 16" in result.stderr
    assert not (tmp_path / "train" / ".submitit").exists()


def test_plan_of_the_355b_rl_job_on_fsdp2_x_ep(tmp_path):
    """experiment=rl lays the 355B model out on FSDP2 x EP 32 with activation checkpointing (RL's generate needs whole
    layers and sequences): it fits, and its phase is off the recipe's clock (no pre-training timeline composed with
    RL's keys, which failed before)."""
    result = forked.run(
        [sys.executable, str(REPO / "run.py"), "task=plan", "experiment=rl", "cluster=h800_1024n", "data.path=/d",
         "init_from=/ckpt", f"paths.sweep_dir={tmp_path}"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fits 80 GiB (with a 10% margin): yes" in result.stdout and "(ep 32, FSDP shard 8192)" in result.stdout
    assert "phase=rl is not on the recipe's clock" in result.stdout and "recipe timeline" not in result.stdout
    assert "MTP weight 0.1 and balancer rate 0 (correction bias frozen) throughout" in result.stdout
    # The colocated FP8 engine on every GPU: 356,785,884,416 weights / TP 8 at one byte = 41.54 GiB, in a share of
    # 0.6 x 80 GiB = 48 GiB, the rest its KV cache (92 layers x 1 KV head per GPU x 128 x 2 x 2 bytes per token).
    assert re.search(r"rollout engine weights +41\.54 GiB", result.stdout), result.stdout
    assert re.search(r"rollout KV \(147K tokens\) +6\.46 GiB", result.stdout), result.stdout
    assert re.search(r"total +69\.26 GiB", result.stdout), result.stdout


def test_plan_refuses_a_colocated_engine_whose_weights_exceed_its_share(tmp_path):
    """In bf16 the 355B weights need 83 GiB per GPU at TP 8, more than the engine's 48 GiB: the plan says what to
    change."""
    result = forked.run(
        [sys.executable, str(REPO / "run.py"), "task=plan", "experiment=rl", "cluster=h800_1024n", "data.path=/d",
         "init_from=/ckpt", "phase.rollout.quantization=null", f"paths.sweep_dir={tmp_path}"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert "fits 80 GiB (with a 10% margin): NO" in result.stdout, result.stdout[-3000:]
    assert (
        "the rollout engine's bf16 weights need 83.1 GiB per GPU at phase.rollout.tensor_parallel_size=8, more than "
        "its share (phase.rollout.gpu_memory_utilization=0.6: 48.0 GiB)" in result.stdout
    )


def test_plan_of_the_355b_phase1_job_matches_hand_arithmetic(tmp_path):
    """6 x 32.08B active x 15T tokens = 2.887e24 FLOPs: yottaFLOPs, not the seeds' "zettaFLOPs"."""
    result = forked.run(
        [
            sys.executable,
            str(REPO / "run.py"),
            "task=plan",
            "experiment=pretrain_phase1",
            "cluster=h800_1024n",
            f"paths.sweep_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "active per token 32,080,359,424" in out
    assert "6 x active x tokens alone: 2.887e+24 FLOPs (2.887 yottaFLOPs)" in out
    flops = float(re.search(r"training FLOPs: ([\d.e+]+) FLOPs", out).group(1))
    # attention: 12 x 93 layers x 96 heads x 128 x 4096; lm_head run by the main model and the MTP layer
    per_token = (
        6 * (32_080_359_424 + 3_988_069_632 - 152 * 3 * 5120 * 1536 + 2 * 151552 * 5120) + 12 * 93 * 96 * 128 * 4096
    )
    assert flops == pytest.approx(per_token * 15e12, rel=5e-4)
    gpu_hours = per_token * 15e12 / (989e12 * 0.4) / 3600
    assert f"{gpu_hours:,.0f} GPU-hours" in out
    assert f"{gpu_hours / 8192 / 24:,.1f} days" in out
    assert "fits 80 GiB (with a 10% margin): yes" in out
    assert not (tmp_path / "train" / ".submitit").exists()  # planning submits nothing
    # the recipe's timeline: one clock through pre-training and mid-training, each phase where the last one ended
    timeline = out[out.index("recipe timeline (recipe=glm45: 23.1T tokens on one clock") :].splitlines()[2:]
    rows = {line.lstrip("* ").split()[0]: line for line in timeline}
    assert list(rows) == ["pretrain1", "pretrain2", "midtrain_repo", "midtrain_reasoning", "midtrain_long"]
    assert rows["pretrain1"].startswith("* ")  # the composed phase
    assert rows["pretrain1"].split()[2:] == "0 -> 15T 0 -> 8.91e-05 16M -> 64M 0.3 -> 0.3 0.001 -> 0.001".split()
    assert rows["pretrain2"].split()[1:] == "15T -> 22T 8.91e-05 -> 2.63e-05 64M -> 64M 0.1 -> 0.1 0 -> 0".split()
    assert rows["midtrain_long"].split()[1:] == "23T -> 23.1T 2.5e-05 -> 2.5e-05 128M -> 128M 0.1 -> 0.1 0 -> 0".split()


# --- on the local Slurm -----------------------------------------------------------------------


def submit(tmp_path: Path, *overrides: str, multirun: bool = False) -> list[str]:
    """python run.py [-m] cluster=local_slurm ...: returns the job ids it printed (it must not wait)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        str(REPO / "run.py"),
        *(["-m"] if multirun else []),
        "cluster=local_slurm",
        f"paths.sweep_dir={tmp_path}",
        *QUICK,
        *overrides,
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = re.findall(r"^  (\d+(?:_\d+)?): ", result.stdout, flags=re.M)
    queued = subprocess.run(["squeue", "-h", "-j", jobs[0].split("_")[0]], capture_output=True, text=True).stdout
    assert queued.strip() and "scancel" in result.stdout  # it returned while the job is still queued or running
    return jobs


def checkpoint_step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


@pytest.mark.slurm
def test_a_job_slurm_refuses_ends_in_one_line_naming_the_request_and_the_answer(tmp_path):
    """The 8-GPU node of cluster=h800_1024n passes validation but the local node has no GPUs: sbatch refuses
    the gres, and the user reads what was asked, from which cluster config, and Slurm's answer."""
    require_slurm()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        str(REPO / "run.py"),
        "experiment=tiny_bytes",
        "cluster=h800_1024n",
        "cluster.partition=debug",
        "cluster.num_nodes=1",
        "parallelism=ddp",
        f"paths.sweep_dir={tmp_path}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    (line,) = [line for line in output.splitlines() if "Slurm refused" in line]
    for part in (
        "Invalid generic resource (gres) specification",
        "--gpus-per-node=8",
        "--nodes=1",
        "--partition=debug",
        "cluster=h800_1024n",
    ):
        assert part in line, (part, line)
    assert output.count("Invalid generic resource") == 1 and "Traceback" not in output, output


@pytest.mark.slurm
@pytest.mark.slow
def test_tiny_training_job_on_local_slurm_completes_with_checkpoint_and_export(tmp_path):
    require_slurm()
    (job,) = submit(tmp_path, "trainer.max_steps=6")
    assert sacct_states(job, timeout=300) == {job: "COMPLETED"}
    run_dir = tmp_path / "train" / job
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == 6
    assert (run_dir / "hf" / "config.json").is_file() and (run_dir / ".hydra" / "config.yaml").is_file()


@pytest.mark.slurm
@pytest.mark.slow
def test_sweep_runs_as_a_job_array_with_one_directory_per_point(tmp_path):
    require_slurm()
    jobs = submit(tmp_path, "trainer.max_steps=3", "optim.lr=0.001,0.003", multirun=True)
    array = jobs[0].split("_")[0]
    assert jobs == [f"{array}_0", f"{array}_1"]
    assert sacct_states(array, records=2, timeout=300) == {job: "COMPLETED" for job in jobs}
    for job, lr in zip(jobs, ("0.001", "0.003")):
        run_dir = tmp_path / "train" / array / job.split("_")[1]  # a sweep's members side by side
        assert f"optim.lr={lr}" in (run_dir / ".hydra" / "overrides.yaml").read_text()
        assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == 3


@pytest.mark.slurm
@pytest.mark.slow
def test_time_limit_requeues_and_the_job_resumes_to_the_same_step_count(tmp_path):
    """A 3-minute limit with the warning 60 s before it (Slurm may send it up to 60 s early): each allocation
    trains at most 105 s (its first ~15 s are the start), saves at a step boundary on SIGUSR1 and requeues itself;
    the job ends with every step done, exactly once. Its steps last at least 1 s each, mostly sleep (220 s in all:
    more than two allocations can hold, so it is interrupted at least twice on any machine, and the third
    allocation is short): the test is about the job's course, not its computation."""
    require_slurm()
    steps = 220
    (job,) = submit(
        tmp_path,
        f"trainer.max_steps={steps}",
        "cluster.time_min=3",
        "cluster.signal_delay_s=60",
        "callbacks.model_checkpoint.every_n_train_steps=1000",
        "+callbacks.slow._target_=tests.helpers.SlowSteps",
        "+callbacks.slow.seconds=1.0",
    )
    assert sacct_states(job, timeout=900) == {job: "COMPLETED"}
    log = next((tmp_path / "train" / ".submitit" / job).glob("*_0_log.out")).read_text()
    interruptions = [int(step) for step in re.findall(r"interrupted at step (\d+)", log)]
    assert len(interruptions) >= 2 and interruptions == sorted(interruptions), log[-2000:]
    run_dir = tmp_path / "train" / job
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == steps
    logged = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines()]
    step_column = logged[0].index("step")
    loss_column = logged[0].index("train/loss")
    loss_steps = [int(row[step_column]) for row in logged[1:] if row[loss_column]]
    assert len(loss_steps) == len(set(loss_steps))  # no step trained (and logged) twice across requeues
