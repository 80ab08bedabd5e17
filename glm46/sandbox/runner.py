"""Run an untrusted program (model-written code, a benchmark's tests) in a sandbox of its own, and say how it ended.

Each run gets a process tree of its own inside bubblewrap (Debian's `bubblewrap`; `make install` installs it):
- every namespace bubblewrap makes (`--unshare-all`): no network (a network namespace with nothing but its own
  loopback), its own PIDs, IPC and hostname;
- a filesystem of the system's directories read-only (/usr, /etc and the Python installation the program runs
  with), a private /tmp, and a working directory of its own (/work) holding the files given; nothing else of this
  machine (the user's files, the repository, the data) exists inside;
- limits (util-linux's prlimit, inherited by everything the program starts): CPU seconds, address space, processes,
  the size of a file written, open files; when started by root, run as a user id of its own with no capabilities
  (`sandbox_uid`: a root caller's process count has no bound, and a process bound counts all of a user's processes,
  so concurrent sandboxes (RL ranks, an evaluation's requests) sharing `nobody` would count each other's);
- a wall-clock bound, at which the whole tree is killed (the process group, and bubblewrap's PID namespace with it),
  and a bound on the output read back (beyond it the tree is killed as well).

A sandbox that cannot start (no bubblewrap, no user namespaces) is an infrastructure failure (`sandbox_error`), kept
apart from a program that fails: open-instruct found 5-15% of its "zero" code rewards to be sandbox failures, and
verl runs such code under firejail with the network off. `Sandbox.check()` says ahead of time whether one can start.
`kind="none"` runs the program with the same limits but no isolation, for machines without user namespaces and only
when said explicitly (eval.sandbox=none).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

KINDS = ("bubblewrap", "none")
UID_BASE = 1_000_000_000  # sandbox user ids: this + the calling thread's id (below pid_max, 2**22), no passwd entry
WORKDIR = "/work"  # the program's working directory inside the sandbox
# How a run ended: the program's own outcome, a bound it hit, or the sandbox's failure (not the program's)
PASSED, FAILED, TIMEOUT, OUTPUT_LIMIT, SANDBOX_ERROR = "passed", "failed", "timeout", "output_limit", "sandbox_error"


@dataclass(frozen=True)
class Limits:
    """Bounds of one run: wall and CPU seconds, address space, processes (of the sandbox's user), the largest file
    written and the output (stdout and stderr, each) read back."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 1 << 30
    processes: int = 64
    file_bytes: int = 16 << 20
    open_files: int = 256
    output_bytes: int = 1 << 20


@dataclass(frozen=True)
class Outcome:
    """status: passed (exit 0), failed (another exit or a signal: the CPU or memory limit included), timeout (the
    wall-clock bound), output_limit, sandbox_error (the sandbox did not start: not the program's failure)."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def infrastructure_failure(self) -> bool:
        return self.status == SANDBOX_ERROR


class Sandbox:
    """Runs programs in bubblewrap (kind="bubblewrap") or, said explicitly, without isolation (kind="none")."""

    def __init__(self, kind: str = "bubblewrap", limits: Limits = Limits(), python: str | None = None):
        if kind not in KINDS:
            raise ValueError(f"sandbox kind {kind!r}: expected one of {list(KINDS)}")
        self.kind, self.limits = kind, limits
        # The interpreter programs run with: the base installation's, not a venv's (its packages stay outside)
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        self.python = python or str(Path(sys.base_prefix) / "bin" / version)

    def check(self) -> str | None:
        """None when a program can run here, else why not (for a refusal before any work is queued)."""
        if self.kind == "bubblewrap" and shutil.which("bwrap") is None:
            return "bubblewrap (bwrap) is not installed: `apt-get install bubblewrap` (make install does)"
        outcome = self.run({"check.py": "print('ok')"}, ["check.py"])
        if outcome.status != PASSED or outcome.stdout.strip() != "ok":
            return f"a sandboxed program could not run ({outcome.status}): {outcome.stderr.strip()[-500:]}"
        return None

    def run(self, files: dict[str, str], argv: list[str], stdin: str = "") -> Outcome:
        """Write `files` (name -> text) into a fresh working directory and run `python <argv>` there."""
        with tempfile.TemporaryDirectory(prefix="glm46-sandbox-") as folder:
            for name, text in files.items():
                path = Path(folder) / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            uid = sandbox_uid() if os.geteuid() == 0 and self.kind == "bubblewrap" else None
            if uid is not None:  # the program's own files and directory, writable by it alone
                for path in [Path(folder), *Path(folder).rglob("*")]:
                    os.chown(path, uid, uid)
            # -E -s: no PYTHON* variables, no user site (the script's own directory stays importable)
            return self._execute(Path(folder), [self.python, "-E", "-s", *argv], stdin, uid)

    def _command(self, folder: Path, program: list[str], start_fd: int, uid: int | None) -> list[str]:
        """prlimit's bounds, then bubblewrap (as root: privileged, then user `uid` with no capabilities by setpriv;
        otherwise unprivileged, in a user namespace of its own), then bash, which writes to `start_fd` once the
        sandbox stands (its failure to stand is then told from the program's) and becomes the program."""
        as_root, limits = uid is not None, self.limits
        prlimit = [
            "prlimit",
            f"--cpu={limits.cpu_seconds}",
            f"--as={limits.memory_bytes}",
            f"--nproc={limits.processes if as_root else limits.processes + _processes_of_this_user()}",
            f"--fsize={limits.file_bytes}",
            f"--nofile={limits.open_files}",
            "--core=0",
            "--",
        ]
        started = ["/bin/bash", "-c", f'printf started >&{start_fd}; exec {start_fd}>&-; exec "$@"', "bash"]
        if self.kind == "none":
            return [*prlimit, *started, *program]
        python_home = Path(sys.base_prefix).resolve()
        system = []
        for name in ("bin", "lib", "lib64", "sbin"):  # Debian's merged /usr: links, else directories
            path = Path("/") / name
            if path.is_symlink():
                system += ["--symlink", os.readlink(path), str(path)]
            elif path.is_dir():
                system += ["--ro-bind", str(path), str(path)]
        for parent in reversed(python_home.parents[:-1]):  # traversable, holding nothing else (/root is 0700)
            system += ["--perms", "0755", "--dir", str(parent)]
        namespaces = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all"]
        drop.append("--bounding-set=-all")
        return [
            *prlimit,
            "bwrap",
            *(namespaces if as_root else ["--unshare-all"]),
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--setenv", "PATH", f"/usr/bin:/bin:{python_home / 'bin'}",
            "--setenv", "HOME", WORKDIR,
            "--setenv", "LANG", "C.UTF-8",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            "--ro-bind", "/usr", "/usr",
            "--ro-bind", "/etc", "/etc",
            *system,
            "--ro-bind", str(python_home), str(python_home),
            "--proc", "/proc",
            "--dev", "/dev",
            "--perms", "1777", "--tmpfs", "/tmp",
            "--bind", str(folder), WORKDIR,
            "--chdir", WORKDIR,
            *(drop if as_root else []),
            *started,
            *program,
        ]  # fmt: skip

    def _execute(self, folder: Path, program: list[str], stdin: str, uid: int | None) -> Outcome:
        started = time.monotonic()
        start_read, start_write = os.pipe()
        try:
            process = subprocess.Popen(
                self._command(folder, program, start_write, uid),
                cwd=folder,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(start_write,),
                start_new_session=True,  # its own process group: killed whole
            )
        except OSError as error:  # prlimit or bwrap missing, or not executable
            os.close(start_read)
            os.close(start_write)
            return Outcome(SANDBOX_ERROR, None, "", f"the sandbox did not start: {error}", 0.0)
        os.close(start_write)
        flooded = threading.Event()
        readers = [_Reader(stream, self.limits.output_bytes, flooded) for stream in (process.stdout, process.stderr)]
        try:
            process.stdin.write(stdin.encode())
            process.stdin.close()
        except BrokenPipeError:
            pass
        timed_out = False
        deadline = started + self.limits.wall_seconds
        while process.poll() is None:
            if flooded.is_set() or time.monotonic() > deadline:
                timed_out = not flooded.is_set()
                _kill_group(process)
                break
            time.sleep(0.01)
        process.wait()
        for reader in readers:
            reader.join()
        with os.fdopen(start_read) as start:
            started_child = start.read() == "started"
        stdout, stderr = (reader.text() for reader in readers)
        seconds = time.monotonic() - started
        if not started_child:
            return Outcome(SANDBOX_ERROR, process.returncode, stdout, stderr, seconds)
        if flooded.is_set():
            return Outcome(OUTPUT_LIMIT, process.returncode, stdout, stderr, seconds)
        if timed_out:
            return Outcome(TIMEOUT, process.returncode, stdout, stderr, seconds)
        return Outcome(PASSED if process.returncode == 0 else FAILED, process.returncode, stdout, stderr, seconds)


class _Reader(threading.Thread):
    """Reads a stream to its end, keeping at most `limit` bytes; more sets `flooded`."""

    def __init__(self, stream, limit: int, flooded: threading.Event):
        super().__init__(daemon=True)
        self.stream, self.limit, self.flooded, self.chunks, self.size = stream, limit, flooded, [], 0
        self.start()

    def run(self) -> None:
        while chunk := self.stream.read1(65536):
            if self.size + len(chunk) > self.limit:
                self.flooded.set()
                chunk = chunk[: self.limit - self.size]
            self.chunks.append(chunk)
            self.size += len(chunk)
            if self.flooded.is_set():
                break
        self.stream.close()

    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the run's process group; bubblewrap's PID namespace dies with its first process."""
    try:
        os.killpg(process.pid, 9)
    except ProcessLookupError:
        pass


def sandbox_uid() -> int:
    """The user id a root caller's sandbox runs as: UID_BASE + the calling thread's id, which no other live thread
    of this machine holds, so no two sandboxes running at once share one (nor their process bound)."""
    return UID_BASE + threading.get_native_id()


def _processes_of_this_user() -> int:
    """How many processes this user runs now: prlimit's process bound counts them all (ulimit -u's)."""
    uid = os.getuid()
    return sum(1 for status in Path("/proc").glob("[0-9]*/status") if _owner(status) == uid)


def _owner(status: Path) -> int | None:
    try:
        return status.stat().st_uid
    except OSError:
        return None
