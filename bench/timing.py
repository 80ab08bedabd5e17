"""Shared by the benchmarks: wall and CPU time of one call, and a worker run on local gloo processes."""

import os
import socket
import time


def timed(run):
    """(what run() returns, its wall seconds, its CPU seconds over all the process's threads)."""
    start, cpu = time.perf_counter(), time.process_time()
    result = run()
    return result, time.perf_counter() - start, time.process_time() - cpu


def spawn_on_gloo(worker, *args, processes: int) -> dict:
    """worker(rank, port, *args, results) on `processes` local processes (one thread each, a free TCP port for the
    gloo rendezvous); returns what they put in `results`, a shared dict."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = mp.Manager().dict()
    mp.spawn(worker, args=(port, *args, results), nprocs=processes)
    return dict(results)
