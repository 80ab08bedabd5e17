"""`python run.py ...` for the tests, forked from the forkserver of tests/ranks.py instead of started as a fresh
interpreter: that server has imported torch, Lightning, Hydra and glm46 once, and importing them is most of what a
short run costs (Lightning alone about 8 CPU-seconds a process on the CI's machines). `run_ranks` starts a
multi-process run's ranks the same way, as torchrun or srun would.

The child is a real process (its own pid, exit status and signals) that runs the script as `python run.py` does:
`__main__`, `sys.argv`, the working directory and the environment given, stdout and stderr captured to files, exit
handlers run. `run` answers as `subprocess.run(..., capture_output=True, text=True)` does; a command that is neither
`python <script>.py ...` nor `python -m <module> ...` runs as a subprocess.
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from glm46.rl.engine import free_port

from .ranks import _context, start_child, wait_all


def _exit_status(code: object) -> int:
    """The exit status of `sys.exit(code)`, as the interpreter makes it (a message is printed and gives 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _script(argv: list[str], cwd: str, env: dict, out: str, err: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    start_child(out, err)
    try:
        if argv[0] == "-m":  # `python -m module ...`: the working directory first on the path
            sys.argv = list(argv[1:])
            sys.path.insert(0, cwd)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # `python script.py ...`: the script's folder first on the path
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        status = 0
    except SystemExit as exit:
        status = _exit_status(exit.code)
    except BaseException:
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()  # a multiprocessing child skips them otherwise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _is_script(command: list[str]) -> bool:
    """`python <script>.py ...` or `python -m <module> ...`."""
    if len(command) < 2 or command[0] != sys.executable:
        return False
    return str(command[1]).endswith(".py") or (command[1] == "-m" and len(command) >= 3)


def _argv(command: list[str], cwd: str) -> list[str]:
    if command[1] == "-m":
        return list(map(str, command[1:]))
    return [str(Path(cwd, command[1])), *map(str, command[2:])]


def _fork_all(command: list[str], cwd: str, envs: list[dict], timeout: float | None) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of `command` forked once per environment, waited for together (wait_all);
    past `timeout`, subprocess.TimeoutExpired with the first's output."""
    with tempfile.TemporaryDirectory() as folder:
        files = [(os.path.join(folder, f"{i}.out"), os.path.join(folder, f"{i}.err")) for i in range(len(envs))]
        processes = [
            _context.Process(target=_script, args=(_argv(command, cwd), cwd, env, out, err))
            for env, (out, err) in zip(envs, files)
        ]
        timed_out = wait_all(processes, timeout)
        outputs = [(Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace")) for out, err in files]
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, *outputs[0])
    return [(p.exitcode, *output) for p, output in zip(processes, outputs)]


def run(
    command: list[str],
    *,
    cwd: str | Path | None = None,
    env: dict | None = None,
    timeout: float | None = None,
    check: bool = False,
    capture_output: bool = True,
    text: bool = True,
) -> subprocess.CompletedProcess:
    """subprocess.run's answer for `command`, with the script forked from the preloaded server."""
    if not (_is_script(command) and capture_output and text):
        kwargs = dict(cwd=cwd, env=env, timeout=timeout, check=check, capture_output=capture_output, text=text)
        return subprocess.run(command, **kwargs)
    cwd = str(Path(cwd or os.getcwd()).resolve())
    ((status, stdout, stderr),) = _fork_all(command, cwd, [dict(env or os.environ)], timeout)
    result = subprocess.CompletedProcess(command, status, stdout, stderr)
    if check:
        result.check_returncode()
    return result


def run_ranks(
    command: list[str], world_size: int, *, cwd: str | Path, env: dict, timeout: float
) -> subprocess.CompletedProcess:
    """`python run.py ...` on `world_size` ranks started as torchrun or srun starts them: each forked with its
    rank in the environment, so Lightning sees an external launcher and starts no processes of its own. Answers
    with rank 0's output, the other ranks' stderr after it, and the exit status of the rank that failed."""
    port = str(free_port())
    rendezvous = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(world_size), NODE_RANK="0")
    envs = [env | rendezvous | {"RANK": str(r), "LOCAL_RANK": str(r)} for r in range(world_size)]
    ranks = _fork_all(command, str(Path(cwd).resolve()), envs, timeout)
    statuses = [status for status, _, _ in ranks]
    # the failed rank's own status, not the SIGKILL of the ranks stopped after it
    status = next((s for s in statuses if s not in (0, -signal.SIGKILL)), next((s for s in statuses if s), 0))
    stderr = "".join(f"\n--- rank {r}\n{err}" if r else err for r, (_, _, err) in enumerate(ranks))
    return subprocess.CompletedProcess(command, status, ranks[0][1], stderr)
