import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from glm46.app.schema import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
BUILD_LEFTOVERS = ("__pycache__", ".pytest_cache", ".ruff_cache", ".egg-info")  # tools' caches, not the tests'


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
