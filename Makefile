# The two commands of the README: `make run` (install + the main job) and `make test` (install + lint + tests).
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install run test test-fast lint

# torch first, pinned, so this machine takes its local CPU build (a loose range could pull a
# multi-GB CUDA build); DeepSpeed then compiles against that torch (it needs no build isolation);
# the package's own ranges are then already satisfied. torchtitan 0.2.2 (the last release that imports under the GPU
# image's torch 2.11, so the same peer runs here and there), the peer of bench/train_throughput.py, bench/gpu_suite.py
# and tests/test_bench_peers.py, comes without its declared dependencies (those of its own trainer and data loaders);
# then what importing its models needs: tyro (its config), torchdata, triton (its MoE's padding kernel). First, Debian's
# bubblewrap, the sandbox of model-written code (glm46.sandbox), where it is missing and apt-get can install it.
# bfcl-eval (BFCL's questions and AST checker, glm46.eval.bfcl) comes without its dependencies: they pin NumPy 1.26
# and bring the API clients of its model handlers, which scoring does not use.
install:
	@command -v bwrap >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap; } \
		|| echo "make install: no bubblewrap (apt-get install bubblewrap): code benchmarks and rewards refuse to run without it"; }
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-build-isolation "deepspeed>=0.19,<0.20"
	$(PIP) install --quiet -e ".[dev,deepspeed]"
	$(PIP) install --quiet --no-deps torchtitan==0.2.2
	$(PIP) install --quiet --no-deps bfcl-eval==2026.3.23
	$(PIP) install --quiet "tyro>=1,<2" triton==3.9.0 torchdata==0.11.0

run: install
	$(PYTHON) run.py

# Three pytest-xdist workers on two cores (one of them mostly waits on Slurm); tests/conftest.py groups the tests into
# units of work (a test file, or every test of one shared resource: Slurm, the engines), each run on one worker.
test: install lint
	$(PYTHON) -m pytest -n 3 --dist loadgroup --no-loadscope-reorder

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test-fast:
	$(PYTHON) -m pytest -m "not slow"
