"""Structured-config schemas registered in Hydra's ConfigStore.

`conf/model/*.yaml` start from `model/schema` (GLM46Config), so Hydra rejects a misspelt key or a
value of the wrong type while composing, naming the key.
"""

from hydra.core.config_store import ConfigStore

from glm46.modules import GLM46Config


def register_configs() -> None:
    ConfigStore.instance().store(group="model", name="schema", node=GLM46Config)
