#!/usr/bin/env bash
# The wheels a GPU machine's image lacks, for bench/gpu_suite.py and training there, downloaded into .whl/ (ignored).
#
# The GPU image this targets has Python 3.12 (x86-64) with torch 2.11 (CUDA), transformers, lightning, torchmetrics,
# tokenizers, tiktoken, safetensors, triton, numpy, scipy, pyyaml, matplotlib, tensorboard and prometheus-client
# (no pandas), and reaches no package index. What glm46 imports beyond those (the config system, dedup, GGUF, submitit) and the peer of the
# throughput rows (torchtitan 0.2.2, the last release that imports under torch 2.11, with what importing its models
# needs; not its dataset loaders' `datasets`, for which bench/torchtitan_glm.py stands in) travel as these wheels,
# pinned to the versions this project is tested with, all pure Python: under 64 MiB together (checked at the end).
# Before a GPU is lent, scripts/gpu_image_check.sh runs them here under the image's Python and torch.
#
#   bash scripts/device_wheels.sh            # -> .whl/*.whl
#   # on the GPU machine, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#   python3 bench/gpu_suite.py
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.whl
WHEELS=(  # name==version; bench/gpu_suite.py reads this list (its environment row checks the pins)
  hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3
  datasketch==2.0.0 submitit==1.5.4 gguf==0.19.0
  torchtitan==0.2.2 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 torchdata==0.11.0
  torchao==0.18.0  # the suite's float8 row (torchao.float8; its pure-Python wheel, without the CUDA kernels)
)
mkdir -p "$OUT"
rm -f "$OUT"/*.whl
for spec in "${WHEELS[@]}"; do
  # Pure-Python wheels fit any Python; a project that publishes only an sdist (antlr4's runtime) is built here.
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
    --platform any -d "$OUT" "$spec" 2>/dev/null \
    || python3 -m pip wheel --quiet --no-deps -w "$OUT" "$spec"
done
python3 - "$OUT" "${WHEELS[@]}" <<'PY'
import sys
from pathlib import Path

folder, specs = Path(sys.argv[1]), sys.argv[2:]
wheels = sorted(folder.glob("*.whl"))
total = sum(w.stat().st_size for w in wheels)
names = {w.name.split("-")[0].lower().replace("_", "-") for w in wheels}
missing = [s for s in specs if s.split("==")[0].lower().replace("_", "-") not in names]
for wheel in wheels:
    print(f"{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
print(f"{total / 2**20:7.2f} MiB in {len(wheels)} wheels under {folder}/")
if missing or total > 64 * 2**20:
    sys.exit(f"missing wheels {missing}" if missing else f"{total / 2**20:.1f} MiB is over the 64 MiB a device call carries")
PY
