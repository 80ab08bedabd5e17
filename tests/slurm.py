"""Helpers for tests that run on the local Slurm of ``scripts/local_slurm.sh`` (marker ``slurm``).

Mark the tests ``slurm`` and call ``require_slurm()`` first (directly or from a fixture): it skips
when no controller answers, unless ``GLM46_REQUIRE_SLURM=1`` (CI), where it fails, so that CI
cannot pass by skipping every Slurm test.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

PARTITION = "debug"
SLURM_DIR = Path(os.environ.get("GLM46_SLURM_DIR", "/tmp/glm46-slurm"))
START_HINT = "start it with `bash scripts/local_slurm.sh start`"
# sacct states after which a job will not change any more.
TERMINAL_STATES = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED",
    "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT",
}  # fmt: skip


@dataclass(frozen=True)
class SlurmCluster:
    partition: str
    conf: str | None  # the slurm.conf clients read (None: Slurm's default path)


def _run(*cmd: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def _point_at_local_cluster() -> None:
    """Let every Slurm client of this process (and of the jobs it submits) find the local
    cluster's config even where /etc/slurm/slurm.conf does not link to it."""
    conf = SLURM_DIR / "etc" / "slurm.conf"
    if "SLURM_CONF" not in os.environ and conf.is_file():
        os.environ["SLURM_CONF"] = str(conf)


def _local_controller_port() -> int | None:
    """slurmctld's port when SLURM_CONF is the local cluster's config (else None: ask sinfo)."""
    conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
    if not conf.is_file() or conf.resolve() != (SLURM_DIR / "etc" / "slurm.conf").resolve():
        return None
    ports = re.findall(r"^SlurmctldPort=(\d+)", conf.read_text(), flags=re.MULTILINE)
    return int(ports[0]) if ports else 6817


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


@functools.cache
def unavailable_reason() -> str | None:
    """Why the local Slurm cannot run jobs now, or None when it can (checked once per process)."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return f"Slurm client commands (sinfo, sbatch) not found; {START_HINT}"
    _point_at_local_cluster()
    port = _local_controller_port()
    if port is not None and not _listening(port):
        # Fast path: sinfo would retry for about 10 s before it gives up.
        return f"the local Slurm controller is not running (nothing listens on 127.0.0.1:{port}); {START_HINT}"
    try:
        info = _run("sinfo", "-h", "-p", PARTITION, "-o", "%a %T")
        if info.returncode != 0:
            return f"the Slurm controller is not answering ({info.stderr.strip()}); {START_HINT}"
        groups = [line.split() for line in info.stdout.splitlines()]  # one line per node state
        if not groups or any(len(g) < 2 or g[0] != "up" for g in groups):
            return f"partition {PARTITION!r} is missing or down (sinfo: {info.stdout.strip()!r}); {START_HINT}"
        if usable_nodes() == 0:
            return f"no node of partition {PARTITION!r} can run jobs (states {[g[1] for g in groups]})"
        acct = _run("sacct", "-n", "-X", "-o", "JobID", "-S", "now")
        if acct.returncode != 0:
            # Without accounting, submitit cannot see a job die and waits for ever.
            return f"sacct is not answering (slurmdbd down?): {acct.stderr.strip()}; {START_HINT}"
    except subprocess.TimeoutExpired as e:
        return f"{e.cmd[0]} timed out: the local Slurm is not answering; {START_HINT}"
    return None


def usable_nodes() -> int:
    """The partition's nodes that can run jobs now (a node killed by a test is down until it is started again)."""
    states = _run("sinfo", "-h", "-N", "-p", PARTITION, "-o", "%T").stdout.split()
    return sum(state.startswith(("idle", "mixed", "alloc", "complet")) for state in states)


def require_slurm(nodes: int = 1) -> SlurmCluster:
    """Skip the calling test when the local Slurm is not up, or has fewer than `nodes` nodes; fail instead under
    GLM46_REQUIRE_SLURM=1."""
    reason = unavailable_reason()
    if reason is None and nodes > 1 and usable_nodes() < nodes:
        reason = (
            f"this test needs {nodes} Slurm nodes and the local cluster has {usable_nodes()} that can run jobs; "
            f"start it with `bash scripts/local_slurm.sh start --nodes {nodes}`"
        )
    if reason is not None:
        if os.environ.get("GLM46_REQUIRE_SLURM") == "1":
            pytest.fail(f"GLM46_REQUIRE_SLURM=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return SlurmCluster(partition=PARTITION, conf=os.environ.get("SLURM_CONF"))


def sacct_states(job_id: str | int, records: int = 1, timeout: float = 60) -> dict[str, str]:
    """{job or array-task id: state} from sacct, once it lists ``records`` records (array tasks),
    all terminal. The accounting can lag the job's end by a moment (an array can first show as one
    record under its id alone). Fails the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        out = _run("sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "JobID,State").stdout
        states = dict(line.split("|", 1) for line in out.splitlines() if "|" in line)
        # "CANCELLED by 0" -> "CANCELLED"
        states = {k: v.split()[0] for k, v in states.items()}
        if len(states) == records and all(s in TERMINAL_STATES for s in states.values()):
            return states
        if time.monotonic() > deadline:
            pytest.fail(f"sacct: job {job_id} not finished after {timeout:.0f} s: {states or out!r}")
        time.sleep(0.5)


def completed(job: str, timeout: float) -> bool:
    """Whether the job ends COMPLETED within `timeout` s. A job Slurm requeues (NODE_FAIL, then PENDING again) is
    waited for; one that ends otherwise (FAILED, CANCELLED, ...) and stays so for 30 s is not coming back."""
    deadline, ended = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        out = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State"], capture_output=True, text=True)
        state = (out.stdout.split() or ["?"])[-1]
        if state == "COMPLETED":
            return True
        if state in TERMINAL_STATES:
            ended = ended or time.monotonic()
            if time.monotonic() - ended > 30:
                return False
        else:
            ended = None
        time.sleep(1)
    return False


def wait_for_job(job, timeout: float = 90):
    """Wait for a submitit job (or array job) to finish, cancelling it and failing the test after
    ``timeout`` seconds: ``job.result()`` alone would wait for ever on a job that never ends."""
    deadline = time.monotonic() + timeout
    while not job.done():
        if time.monotonic() > deadline:
            job.cancel(check=False)
            pytest.fail(f"submitit job {job.job_id} not done after {timeout:.0f} s (state {job.state})")
        time.sleep(0.5)
    return job
