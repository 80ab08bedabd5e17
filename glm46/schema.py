"""What Hydra needs before composing: structured-config schemas and OmegaConf resolvers.

`conf/model/*.yaml` start from `model/schema` (GLM46Config), so Hydra rejects a misspelt key or a
value of the wrong type while composing, naming the key.
"""

import math

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from glm46.modules import GLM46Config


def tokens(*factors: float) -> int:
    """`${tokens:a,b,...}`: a token count as the product of its factors (e.g. steps x batch x seq_len)."""
    return int(math.prod(factors))


def register_configs() -> None:
    ConfigStore.instance().store(group="model", name="schema", node=GLM46Config)
    OmegaConf.register_new_resolver("tokens", tokens, replace=True)
