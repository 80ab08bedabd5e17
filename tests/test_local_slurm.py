"""The local Slurm of scripts/local_slurm.sh runs what the project submits: sbatch jobs and arrays,
accounting (sacct), and submitit jobs, including ones that fail or die (which must not hang)."""

import os
import subprocess
import sys
import time

import pytest
import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError

from .slurm import SlurmCluster, require_slurm, sacct_states, wait_for_job

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
