"""tests/forked.py answers as subprocess.run does, for `python script.py` and `python -m module`: the script's output,
working directory, arguments, environment and exit status (a code, an uncaught exception, a signal), and a timeout."""

import os
import subprocess
import sys

import pytest

from . import forked

SCRIPT = """import os, signal, sys
print(os.getcwd(), sys.argv[1:], os.environ["MARK"], sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "raise":
    raise ValueError("bad input")
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "sleep":
    import time
    time.sleep(60)
sys.exit(int(how) if how.isdigit() else how)
"""


@pytest.mark.parametrize("how", ["0", "3", "a message", "raise", "kill"])
@pytest.mark.parametrize("form", ["script", "module"])
def test_a_forked_script_answers_as_a_subprocess(tmp_path, how, form):
    script = tmp_path / "forked_script.py"
    script.write_text(SCRIPT)
    start = [str(script)] if form == "script" else ["-m", "forked_script"]
    command, env = [sys.executable, *start, how], os.environ | {"MARK": "x"}
    ours = forked.run(command, cwd=tmp_path, env=env)
    theirs = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ours.returncode == theirs.returncode and ours.stdout == theirs.stdout
    assert ours.stderr.splitlines()[0] == "to stderr" and ours.stderr.splitlines()[-1] == theirs.stderr.splitlines()[-1]


def test_a_forked_script_past_its_timeout_is_killed(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    with pytest.raises(subprocess.TimeoutExpired):
        forked.run([sys.executable, str(script), "sleep"], cwd=tmp_path, env=os.environ | {"MARK": "x"}, timeout=5)


RANKS = """import os, sys, time
print(os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"].isdigit())
if sys.argv[1] == "fail" and os.environ["RANK"] == "1":
    sys.exit(3)
if sys.argv[1] == "fail":
    time.sleep(60)
"""


@pytest.mark.parametrize("how", ["pass", "fail"])
def test_ranks_start_as_a_launcher_starts_them_and_one_failing_stops_the_others(tmp_path, how):
    """Each rank sees the launcher's variables; rank 1 exiting 3 ends the run at once with its status, rank 0
    (sleeping) killed."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    result = forked.run_ranks([sys.executable, str(script), how], 2, cwd=tmp_path, env=dict(os.environ), timeout=30)
    assert result.stdout.split() == ["0", "0", "2", "True"]
    assert result.returncode == (3 if how == "fail" else 0)  # within the timeout: rank 0's sleep was cut short
