"""The local Slurm of scripts/local_slurm.sh runs what the project submits: sbatch jobs and arrays,
accounting (sacct), and submitit jobs, including ones that fail or die (which must not hang); a glm46 job whose
rank dies ends at once and its requeue finishes the run."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError

from . import test_dead_rank as dead_rank
from .slurm import SlurmCluster, require_slurm, sacct_states, wait_for_job

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slurm


@pytest.fixture
def cluster() -> SlurmCluster:
    return require_slurm()


def sbatch(*args: str, cwd) -> str:
    """Submit, wait for the end (sbatch --wait, bounded) and return the job id."""
    out = subprocess.run(
        ["sbatch", "--parsable", "--wait", *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    if out.returncode != 0:
        pytest.fail(f"sbatch {' '.join(args)} exited {out.returncode}: {out.stdout}{out.stderr}")
    return out.stdout.strip().split(";")[0]


def executor(folder, cluster):
    """A submitit executor on the local partition; one fresh folder per test, since job ids restart
    at 1 when the cluster's state is wiped and a reused folder would return stale results."""
    ex = submitit.AutoExecutor(folder=folder)
    assert ex.cluster == "slurm"
    ex.update_parameters(slurm_partition=cluster.partition, timeout_min=5, cpus_per_task=1, mem_gb=1)
    return ex


def test_sbatch_wrap_completes(cluster, tmp_path):
    job_id = sbatch("-p", cluster.partition, "-o", "out.txt", "--wrap", "echo glm46-ok $SLURM_JOB_ID", cwd=tmp_path)
    assert (tmp_path / "out.txt").read_text().strip() == f"glm46-ok {job_id}"
    assert sacct_states(job_id) == {job_id: "COMPLETED"}


def test_sbatch_array_runs_every_task(cluster, tmp_path):
    job_id = sbatch(
        "-p", cluster.partition, "--array=0-1", "-o", "out_%a.txt",
        "--wrap", "echo task $SLURM_ARRAY_TASK_ID of $SLURM_ARRAY_TASK_COUNT",
        cwd=tmp_path,
    )  # fmt: skip
    for task in (0, 1):
        assert (tmp_path / f"out_{task}.txt").read_text().strip() == f"task {task} of 2"
    assert sacct_states(job_id, records=2) == {f"{job_id}_0": "COMPLETED", f"{job_id}_1": "COMPLETED"}


def test_submitit_job_returns_result(cluster, tmp_path):
    def where_am_i(x):
        return x * 2, os.environ["SLURM_JOB_ID"], os.environ["SLURM_JOB_PARTITION"], sys.executable

    job = executor(tmp_path, cluster).submit(where_am_i, 21)
    value, job_id, partition, python = wait_for_job(job).result()
    assert (value, job_id, partition) == (42, job.job_id, cluster.partition)
    assert python == sys.executable
    assert sacct_states(job.job_id) == {job.job_id: "COMPLETED"}


def test_submitit_map_array(cluster, tmp_path):
    jobs = executor(tmp_path, cluster).map_array(pow, [2, 3], [2, 2])
    assert [wait_for_job(j).result() for j in jobs] == [4, 9]


def test_submitit_failure_raises_promptly(cluster, tmp_path):
    def fail():
        raise ValueError("glm46 job failed on purpose")

    job = executor(tmp_path, cluster).submit(fail)
    with pytest.raises(FailedJobError, match="glm46 job failed on purpose"):
        wait_for_job(job, timeout=60).result()


def test_submitit_dead_job_raises_promptly(cluster, tmp_path):
    """A job that dies before writing its result is only seen through sacct (without slurmdbd,
    result() hangs for ever). submitit then waits 15 s more for a late result file (slow shared
    file systems) before it raises: about 17 s in all."""
    start = time.monotonic()
    job = executor(tmp_path, cluster).submit(os._exit, 3)
    with pytest.raises(UncompletedJobError, match="has not produced any output"):
        wait_for_job(job, timeout=60).result()
    assert time.monotonic() - start < 60
    assert sacct_states(job.job_id) == {job.job_id: "FAILED"}


def submit_run(tmp_path, *overrides: str) -> str:
    """`python run.py cluster=local_slurm ...` (it returns once queued): the job id it printed."""
    result = subprocess.run(
        [sys.executable, str(REPO / "run.py"), "cluster=local_slurm", f"paths.sweep_dir={tmp_path}", *overrides],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return re.findall(r"^  (\d+): ", result.stdout, flags=re.M)[0]


def job_log(tmp_path, job: str) -> str:
    return (tmp_path / "train" / ".submitit" / job / f"{job}_0_log.out").read_text()


@pytest.mark.slow
def test_a_job_that_fails_at_start_every_time_stops_after_the_limit_with_the_reason(cluster, tmp_path):
    """An exception in the run (a callback that does not import) makes the task exit non-zero (Hydra's run_job alone
    would swallow it); the job restarts itself up to cluster.max_restarts, then ends FAILED, every failure's cause
    (the exception) and the decision in restarts.json, the traceback in the log."""
    job = submit_run(
        tmp_path,
        "experiment=tiny_bytes",
        "+callbacks.broken._target_=tests.nope.Missing",
        "cluster.max_restarts=1",
        "cluster.restarts_without_progress=2",
    )
    assert sacct_states(job, timeout=300) == {job: "FAILED"}
    restarts = json.loads((tmp_path / "train" / job / "restarts.json").read_text())
    assert [r["decision"] for r in restarts] == ["restarted", "stopped: cluster.max_restarts=1 restarts already made"]
    assert all("Error locating target 'tests.nope.Missing'" in r["cause"] for r in restarts), restarts
    assert all(r["checkpoint_step"] == -1 for r in restarts)
    assert "No module named 'tests.nope'" in job_log(tmp_path, job)


class SleepInsideAStep(L.Callback):
    """Global rank `rank` sleeps as it starts the step after `step` optimizer steps, once per run (`marker`)."""

    def __init__(self, rank: int, step: int, marker: str):
        self.rank, self.step, self.marker = rank, step, Path(marker)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step and not self.marker.exists():
            self.marker.write_text(str(time.time()))
            sleep_inside_the_step()


def sleep_inside_the_step() -> None:
    time.sleep(3600)


def _fault(name: str, target: type, step: int, marker: Path) -> list[str]:
    return [
        f"+callbacks.{name}._target_={target.__module__}.{target.__qualname__}",
        f"+callbacks.{name}.rank=1",
        f"+callbacks.{name}.step={step}",
        f"+callbacks.{name}.marker={marker}",
    ]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_job_whose_rank_dies_twice_and_hangs_once_restarts_itself_to_the_uninterrupted_weights(cluster, tmp_path):
    """2 tasks (DDP on gloo), a checkpoint every step. Rank 1 is SIGKILLed at the start of step 3, then of step 4 of
    the restarted job, then sleeps inside step 5: srun's --kill-on-bad-exit ends the other rank at once after a
    kill, and each rank's watchdog (bound 10 s one step after a resume) dumps its stacks and ends it after the hang,
    instead of parallelism.timeout_s. Each failure requeues the job (cluster.max_restarts=3 on Slurm
    clusters), which resumes from its newest checkpoint; it ends COMPLETED with the weights of a run never
    interrupted, restarts.json naming each cause."""
    markers = [tmp_path / name for name in ("killed-1", "killed-2", "slept")]
    job = submit_run(
        tmp_path,
        *dead_rank.RUN,
        "logger=csv",
        "callbacks.model_checkpoint.every_n_train_steps=1",
        "callbacks.watchdog.factor=5",
        "callbacks.watchdog.min_seconds=5",
        "callbacks.watchdog.first_step_seconds=10",  # the hang comes 1 step after a resume: too soon to time steps
        *_fault("kill", dead_rank.KillRankAtStep, 2, markers[0]),
        *_fault("kill_again", dead_rank.KillRankAtStep, 3, markers[1]),
        *_fault("sleep", SleepInsideAStep, 4, markers[2]),
    )
    straight, _ = dead_rank.run(tmp_path / "straight")  # meanwhile, the same run on 2 local processes
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert sacct_states(job, timeout=600) == {job: "COMPLETED"}, job_log(tmp_path, job)[-3000:]
    run_dir = tmp_path / "train" / job
    restarts = json.loads((run_dir / "restarts.json").read_text())
    assert [(r["checkpoint_step"], r["decision"]) for r in restarts] == [
        (2, "restarted"),
        (3, "restarted"),
        (4, "restarted"),
    ]
    assert all(re.search(r"srun: error: \S+: task 1: Killed", r["cause"]) for r in restarts[:2]), restarts
    assert "glm46 watchdog: rank" in restarts[2]["cause"], restarts[2]
    for restart, marker in zip(restarts, markers):
        ended = time.mktime(time.strptime(restart["time"], "%Y-%m-%dT%H:%M:%S")) - float(marker.read_text())
        print(f"{marker.name}: the job's step ended {ended:.0f} s later")
        assert ended < 10 + dead_rank.ENDS_WITHIN_S
    dump = (run_dir / "hangs" / "rank1-step4.txt").read_text()
    assert "in sleep_inside_the_step" in dump and "in on_train_batch_start" in dump, dump[:3000]
    dead_rank.assert_same_weights(run_dir, tmp_path / "straight")
