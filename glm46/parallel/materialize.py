"""Materialise a model that was built on the meta device and then sharded (glm46.parallel.parallelize):
each rank allocates only its own shards (`to_empty`) and initialises them in place with the model's
init rules (glm46.modules.model.initialize), module by module. No rank ever holds a whole sharded weight.

Random draws on shards: DTensor's RNG tracker (which makes the shards of one tensor draw different
numbers) does not run on CPU meshes, and drawing each shard from the global RNG would give every
shard the same numbers. Here each weight first takes one draw of the global RNG (the same on every
rank after `seed_everything`), then fills its local shard from a generator seeded by that draw and
the shard's global offset: replicas of a shard agree, different shards differ, on any device. The
numbers depend on the layout, as they do in torchtitan (torch issue 168058): runs compared across
layouts start from the same weights (`init_from`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from glm46.modules import GLM46ForCausalLM

from .shards import local_box


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


@torch.no_grad()
def sharded_normal_(tensor: torch.Tensor, std: float) -> None:
    """N(0, std) in place on this rank's shard (see the module docstring); a plain tensor draws from the global RNG."""
    seed = int(torch.randint(0, 2**62, ()))  # advances the global RNG alike on every rank
    if not isinstance(tensor, DTensor):
        tensor.normal_(0.0, std)
        return
    local = tensor.to_local()
    offset = tuple(s.start for s in local_box(tensor))
    generator = torch.Generator(device=local.device).manual_seed(hash((seed, *offset)) % 2**63)
    local.normal_(0.0, std, generator=generator)


def materialize(model: GLM46ForCausalLM, device: torch.device | str) -> GLM46ForCausalLM:
    """Allocate the shards of a meta-device model on `device` and initialise them; returns the model."""
    model.to_empty(device=device)
    model.init_weights(normal_=sharded_normal_)
    return model
