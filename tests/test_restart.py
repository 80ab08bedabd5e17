"""glm46.app.restart's decision and record, without Slurm (the Slurm tests: tests/test_local_slurm.py)."""

from __future__ import annotations

from glm46.app.restart import decide, failure_cause, newest_step


def entry(step: int, decision: str = "restarted") -> dict:
    return {"checkpoint_step": step, "decision": decision}


def test_a_failure_restarts_until_the_limit():
    assert decide([], -1, 3, 1) == (True, "restarted")
    assert decide([entry(2), entry(4)], 6, 3, 1) == (True, "restarted")
    assert decide([entry(2), entry(4), entry(6)], 8, 3, 1) == (
        False,
        "stopped: cluster.max_restarts=3 restarts already made",
    )
    assert decide([], 5, 0, 1)[0] is False


def test_a_failure_that_repeats_without_a_new_checkpoint_stops():
    restart, why = decide([entry(4)], 4, 5, 1)
    assert not restart and why.startswith("stopped: failed 2 times in a row with the newest checkpoint at step 4")
    assert decide([entry(4)], 4, 5, 2) == (True, "restarted")  # allowed twice in a row
    assert decide([entry(2), entry(4)], 4, 5, 1)[0] is False
    assert decide([entry(4), entry(6)], 6, 5, 1)[0] is False
    assert decide([entry(4), entry(6)], 8, 5, 1) == (True, "restarted")  # progress since: the count starts again


def test_the_cause_is_the_last_error_line_of_the_logs(tmp_path):
    log = tmp_path / "123_0_log.out"
    log.write_text(
        "step 3/6\nTraceback (most recent call last):\nValueError: bad batch\nsrun: error: node1: task 1: Killed\n"
    )
    assert failure_cause([log], 137) == "123_0_log.out: ValueError: bad batch; srun: error: node1: task 1: Killed"
    log.write_text(
        "srun: error: node1: task 0: Exited with exit code 1\nglm46 restart: failure 1 ...; restarted\nstep 3/6\n"
        "srun: error: node1: task 1: Killed\n[rank0]: RuntimeError: Connection closed by peer\n"
        "srun: error: node1: task 0: Exited with exit code 1\n"
    )
    assert failure_cause([log], 137) == "123_0_log.out: srun: error: node1: task 1: Killed"  # rank 0's error follows
    assert failure_cause([tmp_path / "missing.out"], 137) == "the job step exited with status 137"


def test_the_newest_checkpoint_step_comes_from_the_periodic_checkpoints(tmp_path):
    assert newest_step(tmp_path) == -1
    (tmp_path / "checkpoints").mkdir()
    for name in ("step0000002.ckpt", "step0000010.ckpt", "last.ckpt"):
        (tmp_path / "checkpoints" / name).write_text("")
    assert newest_step(tmp_path) == 10
