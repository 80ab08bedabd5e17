"""task=dryrun: the real model, mesh, parallelize code and optimizer at the job's real world size, as one rank,
on torch's fake process group. Each dry run is its own process (the fake group is process-wide): this file
as a script, `python -m tests.test_dryrun '<json>'`, prints the dry run's figures as JSON."""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import forked

ROOT = Path(__file__).resolve().parents[1]
PHASE1_H800 = ["experiment=pretrain_phase1", "cluster=h800_1024n", "data.path=/nowhere/no-data-needed"]
# The 128K phase on its layout (no stages, TP 8 + SP, EP 32), each row further split over 2 context-parallel ranks
MIDTRAIN_LONG_CP2_H800 = [
    "experiment=midtrain_long",
    "cluster=h800_1024n",
    "parallelism.context_parallel=2",
    "data.path=/nowhere/no-data-needed",
    "init_from=/nowhere/no-weights-read",
]
# GRPO's trainer side (FSDP2 x EP 32), beside a colocated FP8 vLLM engine that takes 60% of each GPU
RL_H800 = [
    "experiment=rl",
    "cluster=h800_1024n",
    "data.path=/nowhere/no-data-needed",
    "init_from=/nowhere/no-weights-read",
]
AIR_H100 = [
    "experiment=pretrain_phase1",
    "cluster=h100_8n",
    "model=glm45_air_106b",
    "parallelism=fsdp2_ep",
    "parallelism.expert_parallel=8",
    "parallelism.activation_checkpointing=true",
    "data.path=/nowhere/no-data-needed",
]


def main(spec: dict) -> None:
    from hydra import compose, initialize_config_dir

    from glm46.app.tasks import dryrun_job
    from glm46.config.checks import validate
    from glm46.config.schema import register_configs

    if spec.get("leave_replicated"):  # a broken layout: FSDP2 never applied, every parameter left whole
        import glm46.parallel.parallelize as parallelize

        parallelize.apply_fsdp = lambda *args, **kwargs: None
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["task=dryrun", *spec["overrides"]])
    print(json.dumps(dryrun_job(cfg, validate(cfg))))


def dry_run(overrides: list[str], **spec) -> subprocess.CompletedProcess:
    return forked.run(
        [sys.executable, "-m", "tests.test_dryrun", json.dumps({"overrides": overrides, **spec})],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def figures(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [PHASE1_H800, MIDTRAIN_LONG_CP2_H800, RL_H800, AIR_H100],
    ids=["355b-h800_1024n", "355b-128k-cp2-h800_1024n", "355b-rl-h800_1024n", "air-h100_8n"],
)
def test_rank_0_holds_exactly_the_shards_the_plan_counts(overrides):
    """Rank 0 has the largest shards (torch.chunk rounds up): its bytes by group equal the plan's to the byte."""
    run = figures(dry_run(overrides + ["dryrun.rank=0"]))
    assert run["state"] == run["planned"]
    assert sum(sum(g.values()) for g in run["state"].values()) > 0


@pytest.mark.slow
def test_other_ranks_hold_at_most_the_plan_and_the_experts_are_spread_evenly():
    """The last rank of the 355B layout (the last pipeline stage, data-parallel coordinate 63) holds no router rows
    where rank 0 holds 3 (torch.chunk rounds 160 rows over 64 ranks up, leaving the last ranks empty) and the same
    routed-expert bytes: 5 experts per ep rank split by rows over the ranks holding them, not one whole expert on 5
    of them. Its largest all-gather is the lm_head, which lives on the last stage only."""
    run = figures(dry_run(PHASE1_H800 + ["dryrun.rank=8191"]))
    for group, kinds in run["state"].items():
        for kind, nbytes in kinds.items():
            assert nbytes <= run["planned"][group][kind], (group, kind)
    assert run["state"]["routed experts"] == run["planned"]["routed experts"]
    assert run["state"]["routed experts"]["weights"] > 0
    assert run["state"]["router"]["weights"] == 0 < run["planned"]["router"]["weights"]
    what, nbytes = run["largest_gather"]
    assert what.startswith("lm_head.weight") and nbytes == 2 * 151552 * 5120


@pytest.mark.slow
def test_a_parameter_left_replicated_is_reported_by_name():
    result = dry_run(PHASE1_H800, leave_replicated=True)
    assert result.returncode != 0
    assert "not sharded as planned" in result.stderr
    assert "model.embed_tokens.weight is replicated: this rank holds (151552, 5120) of (151552, 5120)" in result.stderr


@pytest.mark.slow
def test_a_rank_that_does_not_fit_its_gpu_fails():
    result = dry_run(PHASE1_H800 + ["cluster.gpu.memory_gib=8"])
    assert result.returncode != 0
    refusal = r"dry run, rank 0: (\d+\.\d) GiB does not fit 90% of 8 GiB \(cluster.gpu.memory_gib\)"
    found = re.search(refusal, result.stderr)
    assert found and float(found[1]) > 0.9 * 8


@pytest.mark.slow
def test_the_production_command_dry_runs_without_data_or_gpu_in_little_memory(tmp_path):
    """The README's command: exits 0, writes nothing outside its working directory, peak memory under 4 GiB."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "task=dryrun", *PHASE1_H800, f"paths.sweep_dir={tmp_path}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dry run: rank 0 of 8192 (fake process group)" in result.stdout
    assert "(90% usable: fits)" in result.stdout
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert max(peak_kib, before) < 4 * 2**20, f"peak RSS {peak_kib / 2**20:.2f} GiB"
    assert not (tmp_path / "dryrun" / ".submitit").exists()  # a dry run is never queued


def test_a_rank_outside_the_world_is_refused(tmp_path):
    result = forked.run(
        [
            sys.executable,
            str(ROOT / "run.py"),
            "task=dryrun",
            "parallelism=fsdp2",
            "cluster.devices=4",
            "dryrun.rank=4",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "dryrun.rank=4 must be in [0, world size 4)" in result.stderr


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))


def test_the_plan_counts_the_newton_schulz_workspace_of_optim_ns_batch_bytes(compose_config):
    """Sized from the device (1/64 of 80 GiB = 1.25 GiB), bounded by what a rank orthogonalises; a smaller batch
    shrinks it, AdamW has none."""
    import torch

    from glm46.config.checks import model_config
    from glm46.optim.newton_schulz import workspace_bytes
    from glm46.planning.sizing import composed_plan

    def plan(*overrides):
        cfg = compose_config("experiment=pretrain_phase1", "cluster=h800_1024n", *overrides)
        return cfg, composed_plan(cfg, model_config(cfg))[0]["memory"]

    cfg, memory = plan()
    assert cfg.optim.ns_batch_bytes == cfg.optim.optimizer.ns_batch_bytes == 1280 * 2**20
    assert 0 < memory["Newton-Schulz workspace"] < workspace_bytes(cfg.optim.ns_batch_bytes, torch.bfloat16)
    _, small = plan("optim.ns_batch_bytes=16777216")
    assert small["Newton-Schulz workspace"] == workspace_bytes(2**24, torch.bfloat16)  # 4 x 16 MiB in bf16
    assert small["total"] < memory["total"]
    _, adamw = plan("optim=adamw")
    assert "Newton-Schulz workspace" not in adamw


def test_the_production_pipeline_runs_each_step_as_one_schedule(compose_config):
    """pretrain_phase1 on 1,024 nodes: 16 microbatches per batch x the step's accumulation (4 at the warm-up's 16M
    tokens, 16 at 64M) in one Interleaved1F1B schedule of 32 stages over 16 ranks: a bubble of 15 / (2 x 64 + 15)
    = 10.5% down to 2.8%, where a schedule per batch idled 15 / (2 x 16 + 15) = 31.9% of every step. The memory is
    planned at the largest step: rank 0 now reaches its schedule's steady state (47 chunks in flight)."""
    from glm46.config.checks import model_config
    from glm46.planning.sizing import composed_plan

    def plan(experiment: str) -> dict:
        cfg = compose_config(f"experiment={experiment}", "cluster=h800_1024n")
        return composed_plan(cfg, model_config(cfg))[0]

    result = plan("pretrain_phase1")
    assert result["schedule_microbatches"] == [64, 256]
    assert result["bubble_range"] == pytest.approx([15 / 143, 15 / 527])
    assert result["bubble_range"][0] <= 0.105 and result["fits"]
    # the production layout recomputes each layer (full); the plan prices the other choices on the same rank
    activations = result["activations_by_checkpointing"]
    assert activations["full"] == result["memory"]["activations"]
    assert activations["none"] > activations["selective"] > activations["full"]
    # phase 2 starts at 15T on the recipe's clock, past the warm-up's 500B: every step is the full batch
    assert plan("pretrain_phase2")["schedule_microbatches"] == [256, 256]


@pytest.mark.parametrize(("rows", "ranks"), [(5120, 8192), (160, 256), (8192, 64), (0, 4), (7, 7), (10, 4), (6, 4)])
def test_the_dry_runs_chunking_gives_fsdp2_the_chunks_torchs_does(rows, ranks):
    """The dry run's stand-in for FSDP2's _chunk_with_empty (chunks made when read) yields the same chunks, values
    and shapes, indexed from either end, and FSDP2 calls it while the dry run shards."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_param

    from glm46.planning.dryrun import LazyChunks, lazy_chunks

    tensor = torch.arange(rows * 3.0).reshape(rows, 3)
    theirs = _fsdp_common._chunk_with_empty(tensor, ranks, dim=0)
    ours = LazyChunks(tensor, ranks, dim=0)
    assert len(ours) == ranks and [c.shape for c in ours] == [c.shape for c in theirs]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs)) and torch.equal(ours[-1], theirs[-1])
    with pytest.raises(IndexError):
        ours[ranks]
    original = _fsdp_param._chunk_with_empty
    with lazy_chunks():
        assert _fsdp_param._chunk_with_empty is LazyChunks
    assert _fsdp_param._chunk_with_empty is original
