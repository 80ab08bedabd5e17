from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from glm46.app.schema import register_configs

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


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
