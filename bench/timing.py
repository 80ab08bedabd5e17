"""Shared by the benchmarks: wall and CPU time of one call."""

import time


def timed(run):
    """(what run() returns, its wall seconds, its CPU seconds over all the process's threads)."""
    start, cpu = time.perf_counter(), time.process_time()
    result = run()
    return result, time.perf_counter() - start, time.process_time() - cpu
