"""Slurm across nodes, on the local cluster of `bash scripts/local_slurm.sh start --nodes 3`: each node a network
namespace with its own hostname and address, its slurmd's jobs inside it. FSDP2 over two nodes of two ranks and DDP
over two nodes of one rank (the lost-node test's run) go through the same submitit path as the production cluster,
take the rendezvous address from the job's node list, and train as one process does on the same global batch. A node
lost mid-step (every process of it SIGKILLed, as a host that loses power) ends the job; Slurm requeues it onto the
two healthy nodes, it resumes from its newest checkpoint and ends with the weights of a run never interrupted,
restarts.json naming the lost node."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from .helpers import SHORT_RUN, random_model, run_py
from .slurm import completed, require_slurm
from .test_local_slurm import SleepInsideAStep, job_log, submit_run

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.distributed]

GLOBAL_BATCH = 4  # sequences per step, whatever the layout
STEPS = ["trainer.max_steps=6"]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "hf" / "model.safetensors")


def placements(run_dir: Path) -> list[dict]:
    """What each rank of each attempt recorded as it started (glm46.lit.callbacks.RankPlacement)."""
    return [json.loads(line) for line in (run_dir / "ranks.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def initial(tmp_path_factory) -> list[str]:
    """Every run starts from the same random weights (a mesh layout initialises its shards on each rank)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from glm46.config.schema import register_configs
    from glm46.config.values import model_config
    from glm46.hf import save_hf

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        config = model_config(compose(config_name="config", overrides=SHORT_RUN))
    GlobalHydra.instance().clear()
    return [f"init_from={save_hf(random_model(config), tmp_path_factory.mktemp('initial') / 'hf')}"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, initial) -> Path:
    """The reference: one process, the whole global batch in each step."""
    run_dir = tmp_path_factory.mktemp("one_process")
    run_py(*SHORT_RUN, *STEPS, *initial, f"data.batch_size={GLOBAL_BATCH}", f"hydra.run.dir={run_dir}")
    return run_dir


def test_fsdp2_over_two_nodes_of_two_ranks_trains_as_one_process(tmp_path, initial, one_process):
    require_slurm(nodes=2)
    job = submit_run(
        tmp_path,
        *SHORT_RUN,
        *STEPS,
        *initial,
        "parallelism=fsdp2",
        "cluster.num_nodes=2",
        "cluster.devices=2",
        f"data.batch_size={GLOBAL_BATCH // 4}",
    )
    assert completed(job, timeout=300), job_log(tmp_path, job)[-3000:]
    run_dir = tmp_path / "train" / job
    ranks = placements(run_dir)
    assert sorted(r["rank"] for r in ranks) == list(range(4))
    hosts = {r["host"] for r in ranks}
    assert len(hosts) == 2 and "localhost" not in hosts, ranks  # two hosts of their own, not this machine's
    for host in hosts:  # node-local ranks 0 and 1 on each host, one node rank per host
        on_host = [r for r in ranks if r["host"] == host]
        assert sorted(r["local_rank"] for r in on_host) == [0, 1]
        assert len({r["node_rank"] for r in on_host}) == 1
    ours, reference = weights(run_dir), weights(one_process)
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, atol=1e-4, rtol=0, msg=name)


class FirstStepAfterResume(L.Callback):
    """Rank 0 writes the time as it starts its first step of a resumed run (training again)."""

    def __init__(self, marker: str):
        self.marker, self.done = Path(marker), False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and not self.done and trainer.global_step > 0:
            self.marker.write_text(str(time.time()))
        self.done = True


def local_slurm(*args: str) -> None:
    subprocess.run(["bash", str(REPO / "scripts" / "local_slurm.sh"), *args], check=True, timeout=300)


def test_a_lost_node_is_survived_on_the_healthy_nodes_to_the_uninterrupted_weights(tmp_path, initial, one_process):
    """2 nodes of 3, DDP, a checkpoint every step. Rank 1 sleeps inside step 4 while the test kills its node: its
    slurmd and every process of its namespace. Rank 0's collective fails at once; Slurm declares the node down after
    SlurmdTimeout (20 s on the local cluster, 300 s by default), ends the job (NODE_FAIL) and requeues it onto the
    two healthy nodes; it resumes from step 3's checkpoint and ends as the uninterrupted run does."""
    require_slurm(nodes=3)
    asleep, resumed = tmp_path / "asleep", tmp_path / "resumed"
    job = submit_run(
        tmp_path,
        *SHORT_RUN,
        *STEPS,
        *initial,
        "parallelism=ddp",
        "cluster.num_nodes=2",
        "cluster.devices=1",
        f"data.batch_size={GLOBAL_BATCH // 2}",
        "callbacks.model_checkpoint.every_n_train_steps=1",
        f"+callbacks.wait._target_={SleepInsideAStep.__module__}.SleepInsideAStep",  # until the test kills its node
        "+callbacks.wait.rank=1",
        "+callbacks.wait.step=3",
        f"+callbacks.wait.marker={asleep}",
        f"+callbacks.resumed._target_={__name__}.FirstStepAfterResume",
        f"+callbacks.resumed.marker={resumed}",
    )
    deadline = time.monotonic() + 300
    while not asleep.exists():
        assert time.monotonic() < deadline, job_log(tmp_path, job)[-3000:]
        time.sleep(0.2)
    run_dir = tmp_path / "train" / job
    (host,) = [r["host"] for r in placements(run_dir) if r["rank"] == 1]  # rank 1's node, written before its steps
    try:
        local_slurm("kill-node", host)
        killed_at = time.time()
        assert completed(job, timeout=600), job_log(tmp_path, job)[-3000:]
    finally:
        local_slurm("start")  # the node comes back for the other tests
    restarts = json.loads((run_dir / "restarts.json").read_text())
    assert [(r["lost_nodes"], r["checkpoint_step"]) for r in restarts] == [([host], 3)], restarts
    assert restarts[0]["decision"].startswith("restarted"), restarts
    attempts = {}
    for place in placements(run_dir):
        attempts.setdefault(place["attempt"], set()).add(place["host"])
    assert len(attempts) == 2 and host in attempts[0] and host not in attempts[1], attempts
    assert len(attempts[1]) == 2, attempts
    print(f"lost node {host}: training again {float(resumed.read_text()) - killed_at:.0f} s after the kill")
    ours, reference = weights(run_dir), weights(one_process)
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, atol=1e-4, rtol=0, msg=name)
