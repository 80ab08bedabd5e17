#!/usr/bin/env bash
# Builds (once) the separate virtual environment with llama.cpp (through llama-cpp-python, which
# compiles the llama.cpp it vendors) that loads glm46's GGUF exports, and prints its python. The
# build takes several minutes on 2 cores, so the venv is cached: a second call with the same version
# returns at once.
#
#   bash scripts/llama_cpp_venv.sh            # -> /root/.cache/glm46/llama-cpp/llama-cpp-python-0.3.36/bin/python
#   GLM46_LLAMA_CPP_VENV=/path bash scripts/llama_cpp_venv.sh
#
# Only the CPU backend is built (no multimodal library, no server); GGML_NATIVE=OFF keeps the binary
# runnable on another x86-64 machine that shares the cache.
set -euo pipefail
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
VENV="${GLM46_LLAMA_CPP_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/glm46/llama-cpp/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION}"
PYTHON="${PYTHON:-python3}"

# Two callers at once (two CI runs): the second waits for the first one's build, then finds it complete.
mkdir -p "$(dirname "$VENV")"
exec {lock}>"$VENV.lock"
flock "$lock"
if [[ -f "$VENV/.complete" ]]; then
  echo "$VENV/bin/python"
  exit 0
fi
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
{
  CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$VENV/bin/python" -m pip install --quiet "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" numpy
  "$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
} >&2
touch "$VENV/.complete"
echo "$VENV/bin/python"
