import os
import subprocess
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from glm46.config.schema import register_configs
from glm46.data.tokenizer import GLMTokenizer
from glm46.hf import save_hf

from .helpers import train_tiny

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
BUILD_LEFTOVERS = ("__pycache__", ".pytest_cache", ".ruff_cache", ".egg-info")  # tools' caches, not the tests'
# `make test` runs the suite in three pytest-xdist workers (--dist loadgroup), one thread each. A test file is one unit
# of work, so that its module fixtures are built once, except where tests share one resource: the local Slurm's one
# node, the inference engines (each takes both cores and GiBs), and the sandbox's user (`nobody`, whose process
# bound every sandboxed program shares); those run as one unit, one test at a time.
SHARED_RESOURCES = {"slurm": "slurm", "serving": "engines", "llama_cpp": "engines", "sandbox": "sandbox"}
# The markers whose units are queued first, in this order (--no-loadscope-reorder keeps it): Slurm's waits overlap the
# other workers' tests, and the engines and multi-process files (the longest) start early, leaving no long unit last.
FIRST = ("slurm", "serving", "llama_cpp", "distributed")

if "PYTEST_XDIST_WORKER" in os.environ:  # workers share two cores: one thread each, for the runs they start too
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def _queue_position(item: pytest.Item) -> int:
    return next((i for i, marker in enumerate(FIRST) if item.get_closest_marker(marker)), len(FIRST))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        shared = [group for marker, group in SHARED_RESOURCES.items() if item.get_closest_marker(marker)]
        item.add_marker(pytest.mark.xdist_group(shared[0] if shared else item.path.name))
    if "PYTEST_XDIST_WORKER" in os.environ:
        items.sort(key=_queue_position)  # stable: files keep their order


def _repository_files() -> set[str]:
    """Untracked and ignored paths of the checkout (outputs/, multirun/, a stray expert_load.npz, ...)."""
    listing = subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    return {
        line[3:]
        for line in listing.splitlines()
        if line[:2] in ("??", "!!") and not any(part in line for part in BUILD_LEFTOVERS)
    }


@pytest.fixture(scope="session", autouse=True)
def tests_write_nothing_into_the_repository():
    """Runs and tests write under tmp_path only: a file they leave in the checkout fails the session."""
    before = _repository_files()
    yield
    written = sorted(_repository_files() - before)
    assert not written, f"the tests wrote into the repository: {written[:10]}"


@pytest.fixture
def compose_config():
    """Compose conf/config.yaml with overrides, as run.py would."""
    register_configs()

    def _compose(*overrides: str, config_dir: Path = CONF_DIR):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides), return_hydra_config=False)

    yield _compose
    GlobalHydra.instance().clear()


@pytest.fixture(scope="session")
def chat_dataset(tmp_path_factory):
    """The generated sft and rl domains, prepared with a 512-token vocabulary (tests.test_sft.make_chat_dataset)."""
    from .test_sft import make_chat_dataset

    return make_chat_dataset(tmp_path_factory.mktemp("chat"), conversations=60, prompts=150, vocab_size=512)


@pytest.fixture(scope="session")
def trained_chat_model(chat_dataset, tmp_path_factory):
    """(the tiny model trained on chat_dataset's sft domain, its export with the tokenizer): trained once for the
    engines' tests (vLLM, llama.cpp), which need clear argmaxes for greedy decoding to compare."""
    tokenizer = GLMTokenizer.from_file(chat_dataset / "tokenizer.json")
    model = train_tiny(chat_dataset, tokenizer)
    return model, save_hf(model, tmp_path_factory.mktemp("trained") / "hf", tokenizer=tokenizer)
