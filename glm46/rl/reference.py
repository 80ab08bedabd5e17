"""The reference policy of a KL term or penalty: the policy the run starts from, frozen."""

from __future__ import annotations

import torch

from glm46.checkpoint.weights import load_weights
from glm46.errors import ConfigError
from glm46.modules import GLM46ForCausalLM


def starting_policy(config, init_from: str | None, device: torch.device) -> GLM46ForCausalLM:
    """A frozen copy of the policy a run starts from (`init_from`), whole: the reference of a KL term or penalty.
    Refused without init_from (it would be the random initialisation)."""
    if not init_from:
        raise ConfigError("a KL term against the starting policy needs init_from (the policy the run starts from)")
    reference = GLM46ForCausalLM(config).to(device)
    load_weights(reference, init_from)
    return reference.eval().requires_grad_(False)
