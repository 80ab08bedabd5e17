"""llama.cpp from this environment: the llama.cpp venv's python runs llama_cpp_worker.py.

The venv (scripts/llama_cpp_venv.sh: llama-cpp-python, which compiles the llama.cpp it vendors) is found by
$GLM46_LLAMA_CPP_PYTHON, else at its default cache path; `llama_cpp_python()` is None when neither exists.
"""

from __future__ import annotations

from pathlib import Path

from .venv import CACHE, run_script, venv_python

SCRIPT = Path(__file__).with_name("llama_cpp_worker.py")
LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # scripts/llama_cpp_venv.sh builds this one
DEFAULT_VENV = CACHE / "llama-cpp" / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}"
BUILD_SCRIPT = "scripts/llama_cpp_venv.sh"


def llama_cpp_python() -> Path | None:
    return venv_python("GLM46_LLAMA_CPP_PYTHON", DEFAULT_VENV, BUILD_SCRIPT)


def llama_cpp_quantize(python: Path, source: Path, output: Path, ftype: str, timeout_s: float = 3600) -> dict:
    """llama.cpp's quantizer (as `llama-quantize source output ftype`) on an f16 GGUF file."""
    request = {"op": "quantize", "source": str(source), "output": str(output), "ftype": ftype}
    return run_script(python, SCRIPT, request, f"llama.cpp's quantizer on {source}", timeout_s)


def llama_cpp_evaluate(
    python: Path,
    model: Path,
    texts: list[str] = (),
    prompts: list[list[int]] = (),
    max_new_tokens: int = 24,
    stop_ids: list[int] = (),
    scored: list[list[int]] = (),
    conversations: list[list[dict]] = (),
    timeout_s: float = 600,
) -> dict:
    """llama.cpp on a GGUF file: `texts` tokenized, `prompts` continued greedily, `scored` sequences' summed
    negative log-likelihood, `conversations` rendered by the file's chat template (llama_cpp_worker.evaluate)."""
    request = {
        "op": "evaluate", "model": str(model), "texts": list(texts), "prompts": [list(p) for p in prompts],
        "max_new_tokens": max_new_tokens, "stop_ids": list(stop_ids), "scored": [list(s) for s in scored],
        "conversations": list(conversations),
    }  # fmt: skip
    return run_script(python, SCRIPT, request, f"llama.cpp on {model}", timeout_s)
