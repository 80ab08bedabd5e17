"""tests.ranks, the launcher of the multi-process test runs: a failing or hung rank must fail the test, with its log."""

import os
import time

import pytest

from tests.ranks import run_ranks


def _fails_on_rank_1() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} up")
    if dist.get_rank() == 1:
        raise ValueError("planted failure")
    dist.barrier()  # rank 0 waits here for a rank that is gone: the launcher must stop it


def _sleeps() -> None:
    time.sleep(60)


@pytest.mark.distributed
def test_a_failing_rank_stops_the_others_and_fails_with_every_ranks_log(tmp_path):
    with pytest.raises(AssertionError) as failure:
        run_ranks(_fails_on_rank_1, world_size=2, logs=tmp_path, timeout=120)
    message = str(failure.value)
    assert "rank 1 (exit 1)" in message and "ValueError: planted failure" in message
    assert "rank 0 of 2 up" in message and "rank 1 of 2 up" in message


@pytest.mark.distributed
def test_a_rank_past_the_timeout_is_killed(tmp_path):
    started = time.monotonic()
    with pytest.raises(AssertionError, match="ran past 2 s"):
        run_ranks(_sleeps, world_size=1, logs=tmp_path, timeout=2)
    assert time.monotonic() - started < 30
