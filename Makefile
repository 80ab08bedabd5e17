# The two commands of the README: `make run` (install + the main job) and `make test` (install + lint + tests).
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install run test test-fast lint

# torch first, pinned, so this machine takes its local CPU build (a loose range could pull a
# multi-GB CUDA build); DeepSpeed then compiles against that torch (it needs no build isolation);
# the package's own ranges are then already satisfied.
install:
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-build-isolation "deepspeed>=0.19,<0.20"
	$(PIP) install --quiet -e ".[dev,deepspeed]"

run: install
	$(PYTHON) run.py

test: install lint
	$(PYTHON) -m pytest

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test-fast:
	$(PYTHON) -m pytest -m "not slow"
