"""Start the ranks of a multi-process test run as a launcher does (torchrun, srun): one process per rank, each told
its rank by the environment, Lightning in each seeing an external launcher (`LOCAL_RANK` set).

The processes are forked from a server that has imported torch, Lightning and glm46 once (multiprocessing's
forkserver, one per pytest process), instead of each starting a fresh interpreter: importing Lightning costs about
8 CPU-seconds a process, most of what a tiny multi-process test spends. The forkserver is a clean single-threaded
process that only imported modules, so a rank starts from the same state as after those imports.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from glm46.rl.engine import free_port

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ["torch", "lightning", "glm46.lit", "glm46.parallel", "glm46.hf", "glm46.app.tasks", "hydra", "tests.helpers"]
_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def start_child(out: str, err: str) -> None:
    """What a process forked from the server does first: its stdout and stderr go to files (one when `out == err`),
    and what the server read from its own environment when it imported Lightning and torch (the rank, the thread
    count) is read again from the child's."""
    files = {path: open(path, "w") for path in {out, err}}
    os.dup2(files[out].fileno(), 1)
    os.dup2(files[err].fileno(), 2)
    for file in files.values():
        file.close()
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    import torch
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    rank_zero_only.rank = _get_rank() or 0
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _rank(target: Callable, arguments: tuple, rank: int, world_size: int, port: int, log: str) -> None:
    os.chdir(ROOT)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        OMP_NUM_THREADS="1",
    )
    start_child(log, log)
    target(*arguments)


def wait_all(processes: list, timeout: float | None) -> bool:
    """Start `processes` and wait for them together: when one fails, or past `timeout`, the others are killed, as
    torchrun does. Whether the timeout passed."""
    for process in processes:
        process.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    timed_out = False
    while any(p.exitcode is None for p in processes):
        timed_out = deadline is not None and time.monotonic() > deadline
        if timed_out or any(p.exitcode not in (None, 0) for p in processes):
            for p in processes:
                p.kill()
            break
        time.sleep(0.05)
    for p in processes:
        p.join()
    return timed_out


def run_ranks(target: Callable, *arguments, world_size: int, logs: Path, timeout: float = 600) -> None:
    """`target(*arguments)` on `world_size` ranks; returns when all exit 0. A rank that fails stops the others (as
    torchrun does) and the test fails with the tails of every rank's log (logs/rank<r>.log)."""
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    processes = [
        _context.Process(target=_rank, args=(target, arguments, rank, world_size, port, str(logs / f"rank{rank}.log")))
        for rank in range(world_size)
    ]
    wait_all(processes, timeout)
    if any(p.exitcode != 0 for p in processes):
        logged = [logs / f"rank{r}.log" for r in range(world_size)]  # none for a rank that died starting
        tails = "".join(
            f"\n--- rank {r} (exit {p.exitcode})\n{log.read_text()[-4000:] if log.exists() else '(no log)'}"
            for r, (p, log) in enumerate(zip(processes, logged))
        )
        raise AssertionError(f"a rank of {world_size} failed or ran past {timeout} s:{tails}")
