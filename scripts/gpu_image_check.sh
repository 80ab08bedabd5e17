#!/usr/bin/env bash
# The GPU image's torch on this CPU, before a GPU is lent: what changed since the suite last ran on a GPU is run here
# under the image's Python 3.12 and torch 2.11, where a failure costs no device time.
#
#   bash scripts/gpu_image_check.sh [VENV]      # default /tmp/glm46-gpu-image (about 5 GB; 3-4 minutes to build)
#
# The venv holds torch==2.11.0 (PyPI's CUDA build, which imports and runs on a CPU), the packages the image has
# (scripts/device_wheels.sh's header lists them) at the versions this machine's glm46 environment has, and nothing
# else: no pandas, no pyarrow, no datasets. scripts/device_wheels.sh's wheels are installed beside it as on the device
# (`--target`, then PYTHONPATH). It then runs `bench/gpu_suite.py --cpu` and the tests of what a torch release moves:
# compiled layers (recompiles counted), activation checkpointing, host reads, FSDP2's mixed precision, the
# torchtitan and float8 peers, the model. Found by it (2026-12-02): torch 2.11's Dynamo recompiled packed rows per
# batch (a frozen dataclass's fields read as constants), and torchtitan's models did not import without pandas.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/tmp/glm46-gpu-image}
IMAGE_PACKAGES=(transformers lightning torchmetrics tokenizers tiktoken safetensors triton numpy scipy pyyaml
  tensorboard prometheus-client matplotlib pytest pytest-xdist)

pinned=$(python3 - "${IMAGE_PACKAGES[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}" if name != "triton" else name)  # triton: the one torch 2.11 names
    except PackageNotFoundError:
        print(name)
PY
)
if [ ! -x "$VENV/bin/python" ]; then
  for python in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do  # pyenv's shim may hide it
    "$python" --version > /dev/null 2>&1 && break
  done
  "$python" -m venv "$VENV" || { echo "needs Python 3.12, the GPU image's"; exit 1; }
fi
echo "torch==2.11.0" > "$VENV/constraints.txt"
"$VENV/bin/pip" install --quiet --constraint "$VENV/constraints.txt" torch==2.11.0 $pinned
bash scripts/device_wheels.sh > /dev/null
rm -rf "$VENV/site"
"$VENV/bin/pip" install --quiet --no-index --no-deps --no-compile --target "$VENV/site" .whl/*.whl
export PYTHONPATH="$VENV/site:$PWD" OMP_NUM_THREADS=2
"$VENV/bin/python" -c "import torch, sys; print(f'Python {sys.version.split()[0]}, torch {torch.__version__}')"
"$VENV/bin/python" bench/gpu_suite.py --cpu --json "$VENV/gpu_suite.json"
"$VENV/bin/python" - "$VENV/gpu_suite.json" <<'PY'
import json, sys

# the suite fails on a FAIL row itself; a runner that did not import is a skip there (the next peer stands in)
skipped = [r for r in json.load(open(sys.argv[1]))["rows"] if r["verdict"] == "skip" and "Error" in r["detail"]]
for row in skipped:
    print(f"did not import under the image's torch: {row['check']}: {row['detail']}")
sys.exit(1 if skipped else 0)
PY
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -p no:randomly \
  tests/test_compile.py tests/test_activation_checkpointing.py tests/test_host_reads.py tests/test_bench_peers.py \
  tests/test_modules.py \
  "tests/test_parallel.py::test_fsdp2_mixed_precision_on_one_process_is_the_autocast_step_within_bf16" \
  "tests/test_parallel.py::test_fsdp2_with_its_bf16_mixed_precision_policy_trains"
