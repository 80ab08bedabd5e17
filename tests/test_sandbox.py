"""The sandbox against hostile programs: each is killed or refused within its bound, and nothing outside changes; a
sandbox that cannot start is told apart from a program that fails."""

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from glm46.sandbox import FAILED, OUTPUT_LIMIT, PASSED, SANDBOX_ERROR, TIMEOUT, Limits, Sandbox
from glm46.sandbox.runner import sandbox_uid

pytestmark = pytest.mark.sandbox

LIMITS = Limits(wall_seconds=4.0, cpu_seconds=1, memory_bytes=512 << 20, processes=16, output_bytes=64 << 10)
SLACK = 2.0  # seconds beyond a bound for the kill and the process start on a loaded 2-core machine


@pytest.fixture(scope="module")
def sandbox():
    sandbox = Sandbox(limits=LIMITS)
    assert sandbox.check() is None, sandbox.check()
    return sandbox


def run(sandbox, code: str):
    started = time.monotonic()
    outcome = sandbox.run({"program.py": code}, ["program.py"])
    return outcome, time.monotonic() - started


def test_a_program_runs_in_its_own_directory_as_a_user_of_its_own_with_its_files(sandbox):
    outcome = sandbox.run(
        {"program.py": "import os, helper; print(os.getcwd(), os.getuid(), helper.X)", "helper.py": "X = 7"},
        ["program.py"],
        stdin="",
    )
    assert outcome.status == PASSED and outcome.stdout.split() == [
        "/work",
        str(sandbox_uid() if os.geteuid() == 0 else os.getuid()),
        "7",
    ]
    failed, _ = run(sandbox, "raise SystemExit(3)")
    assert failed.status == FAILED and failed.returncode == 3 and not failed.infrastructure_failure


def test_an_endless_loop_is_killed_at_its_cpu_bound(sandbox):
    outcome, seconds = run(sandbox, "while True:\n    pass")
    assert outcome.status == FAILED and outcome.returncode != 0
    assert seconds < LIMITS.cpu_seconds + SLACK + 1


def test_a_sleeping_program_is_killed_at_the_wall_clock_bound(sandbox):
    outcome, seconds = run(sandbox, "import time\ntime.sleep(60)")
    assert outcome.status == TIMEOUT and LIMITS.wall_seconds <= seconds < LIMITS.wall_seconds + SLACK


def test_a_large_allocation_is_refused(sandbox):
    outcome, _ = run(sandbox, "x = bytearray(2 << 30)\nprint('allocated')")
    assert outcome.status == FAILED and "MemoryError" in outcome.stderr and "allocated" not in outcome.stdout


def test_an_output_flood_is_cut_at_its_bound_and_killed(sandbox):
    outcome, seconds = run(sandbox, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert outcome.status == OUTPUT_LIMIT and len(outcome.stdout) == LIMITS.output_bytes
    assert seconds < SLACK


STORM = (
    "import os, time\nwhile True:\n    try:\n        os.fork()\n"
    "    except OSError:\n        print('refused', flush=True)\n        time.sleep(0.5)"
)


def test_a_fork_storm_is_refused_and_leaves_no_process_behind(sandbox):
    outcome, seconds = run(sandbox, STORM)
    assert outcome.status == TIMEOUT and seconds < LIMITS.wall_seconds + SLACK
    assert "refused" in outcome.stdout  # at the process bound, long before the wall clock
    time.sleep(0.5)
    uid = sandbox_uid() if os.geteuid() == 0 else os.getuid()
    survivors = [p for p in Path("/proc").glob("[0-9]*") if _uid(p) == uid and "program.py" in _cmdline(p)]
    assert not survivors, f"{len(survivors)} processes of the storm outlived the sandbox"


@pytest.mark.skipif(os.geteuid() != 0, reason="as root each sandbox runs as a user of its own (CI runs as root)")
def test_a_fork_storm_does_not_take_the_process_bound_of_a_sandbox_running_beside_it(sandbox):
    """A process bound counts all of a user's processes: sandboxes sharing one user (nobody) would share it."""
    children = "import subprocess, sys\nfor _ in range(4):\n    subprocess.run([sys.executable, '-c', ''], check=True)"
    with ThreadPoolExecutor(1) as pool:
        storm = pool.submit(run, sandbox, STORM)
        time.sleep(1.5)  # the storm holds its bound, refused
        outcome, _ = run(sandbox, children + "\nprint('ok')")
        stormed, _ = storm.result()
    assert stormed.status == TIMEOUT and "refused" in stormed.stdout
    assert outcome.status == PASSED and outcome.stdout.strip() == "ok", outcome.stderr


def test_no_socket_reaches_this_machine(sandbox):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port, accepted, done = listener.getsockname()[1], [], threading.Event()

    def serve():
        while not done.is_set():
            try:
                accepted.append(listener.accept())
            except TimeoutError:
                pass

    server = threading.Thread(target=serve)
    server.start()
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    outcome, _ = run(sandbox, code)
    done.set()
    server.join()
    listener.close()
    assert outcome.status == FAILED and "ConnectionRefusedError" in outcome.stderr and not accepted
    resolved, _ = run(sandbox, "import socket\nsocket.getaddrinfo('pypi.org', 443)")
    assert resolved.status == FAILED and "gaierror" in resolved.stderr


def test_the_users_files_are_invisible_and_the_system_is_read_only(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's data")
    reader, _ = run(sandbox, f"print(open({str(secret)!r}).read())")
    assert reader.status == FAILED and "FileNotFoundError" in reader.stderr and "data" not in reader.stdout
    here = Path(__file__).resolve()
    source, _ = run(sandbox, f"print(open({str(here)!r}).read())")
    assert source.status == FAILED and "FileNotFoundError" in source.stderr
    for target in ("/usr/lib/escaped", "/etc/escaped", f"{tmp_path}/escaped"):
        writer, _ = run(sandbox, f"open({target!r}, 'w').write('x')")
        assert writer.status == FAILED and not Path(target).exists(), target
    scratch, _ = run(sandbox, "open('/tmp/scratch', 'w').write('x'); open('local', 'w').write('x'); print('ok')")
    assert scratch.status == PASSED and not Path("/tmp/scratch").exists()
    assert secret.read_text() == "the user's data"


def test_a_sandbox_that_cannot_start_is_an_infrastructure_failure(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # neither prlimit nor bwrap can be found
    broken = Sandbox(limits=LIMITS)
    outcome = broken.run({"program.py": "print(1)"}, ["program.py"])
    assert outcome.status == SANDBOX_ERROR and outcome.infrastructure_failure
    assert "did not start" in broken.check() or "not installed" in broken.check()


def _uid(process: Path) -> int | None:
    try:
        return process.stat().st_uid
    except OSError:
        return None


def _cmdline(process: Path) -> str:
    try:
        return (process / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
