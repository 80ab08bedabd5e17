"""Run a script in another virtual environment (vLLM's, llama.cpp's) with a JSON request and a JSON result.

The engines pin their own torch (vLLM) or compile native code (llama.cpp), so each lives in a venv of its own built
by a script under scripts/, cached under ~/.cache/glm46, and found by an environment variable or that cache path.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "glm46"
# vLLM opens its ZMQ sockets at ipc://$VLLM_RPC_BASE_PATH/<uuid> (default: the temporary folder). An engine that is
# killed rather than shut down leaves them behind, so each engine glm46 starts gets a folder of its own, removed after.
VLLM_IPC_VARIABLE = "VLLM_RPC_BASE_PATH"


def ipc_folder() -> tempfile.TemporaryDirectory:
    """A new folder for an engine's IPC sockets (VLLM_IPC_VARIABLE), removed with what it holds on `cleanup` (or at
    the end of a `with` block)."""
    return tempfile.TemporaryDirectory(prefix="glm46-ipc-", ignore_cleanup_errors=True)


def venv_python(variable: str, default_venv: Path, build_script: str) -> Path | None:
    """$variable's interpreter, else the default venv's when it is complete (its build script finished), else None."""
    if path := os.environ.get(variable):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{variable}={path} does not exist: run {build_script}")
        return Path(path)
    complete = (default_venv / ".complete").is_file()
    return default_venv / "bin" / "python" if complete else None


def run_script(
    python: Path, script: Path, request: dict, what: str, timeout_s: float, env: dict[str, str] | None = None
) -> dict:
    """`python -P script request.json result.json` with this environment's PYTHONPATH removed (the venv's own
    packages only): the result, or a RuntimeError naming `what` with the script's stderr."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"} | (env or {})
    with tempfile.TemporaryDirectory(prefix="glm46-venv-") as folder:
        request_file, result_file = Path(folder) / "request.json", Path(folder) / "result.json"
        request_file.write_text(json.dumps(request))
        run = subprocess.run(
            [str(python), "-P", str(script), str(request_file), str(result_file)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if run.returncode != 0 or not result_file.is_file():
            raise RuntimeError(f"{what} failed (exit {run.returncode}):\n{run.stderr[-6000:]}")
        return json.loads(result_file.read_text())
