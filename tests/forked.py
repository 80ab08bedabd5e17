"""`python run.py ...` for the tests, forked from the forkserver of tests/ranks.py instead of started as a fresh
interpreter: that server has imported torch, Lightning, Hydra and glm46 once, and importing them is most of what a
short run costs (Lightning alone about 8 CPU-seconds a process on the CI's machines).

The child is a real process (its own pid, exit status and signals) that runs the script as `python run.py` does:
`__main__`, `sys.argv`, the working directory and the environment given, stdout and stderr captured to files, exit
handlers run. `run` answers as `subprocess.run(..., capture_output=True, text=True)` does; a command that is neither
`python <script>.py ...` nor `python -m <module> ...` runs as a subprocess.
"""

from __future__ import annotations

import atexit
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from .ranks import _context, start_child


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
    with tempfile.TemporaryDirectory() as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        if command[1] == "-m":
            argv = list(map(str, command[1:]))
        else:
            argv = [str(Path(cwd, command[1])), *map(str, command[2:])]
        process = _context.Process(target=_script, args=(argv, cwd, dict(env or os.environ), out, err))
        process.start()
        process.join(timeout)
        timed_out = process.exitcode is None
        if timed_out:
            process.kill()
            process.join()
        stdout, stderr = Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace")
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    result = subprocess.CompletedProcess(command, process.exitcode, stdout, stderr)
    if check:
        result.check_returncode()
    return result
