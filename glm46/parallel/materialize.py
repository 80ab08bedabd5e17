"""Materialise a model that was built on the meta device and then sharded (glm46.parallel.parallelize):
each rank allocates only its own shards (`to_empty`) and initialises them in place with the model's
init rules (glm46.modules.model.initialize), module by module. No rank ever holds a whole sharded weight.

Random draws on shards: DTensor's RNG tracker (which makes the shards of one tensor draw different
numbers) does not run on CPU meshes, and drawing each shard from the global RNG would give every
shard the same numbers. Here each shard draws from a generator seeded by the run's seed, the
weight's position in the init order and the shard's global offset (ShardedNormal): replicas of a
shard agree, different shards differ, on any device. The
numbers depend on the layout, as they do in torchtitan (torch issue 168058): runs compared across
layouts start from the same weights (`init_from`).
"""

from __future__ import annotations

import torch
from torch import nn

from glm46.modules import GLM46ForCausalLM

from .boxes import local_box, local_tensor


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


class ShardedNormal:
    """`normal_(tensor, std)` for glm46.modules.model.initialize on a sharded model: the k-th weight initialised
    fills this rank's part of it (a DTensor's local shard, or all of a plain tensor) from a generator seeded by
    (seed, k, the part's global offset). Nothing depends on the global RNG's position, which data loading or
    other per-rank work may have moved differently on each rank."""

    def __init__(self, seed: int):
        self.seed, self.calls = seed, 0

    @torch.no_grad()
    def __call__(self, tensor: torch.Tensor, std: float) -> None:
        self.calls += 1
        local = local_tensor(tensor)
        offset = tuple(s.start for s in local_box(tensor))
        generator = torch.Generator(device=local.device).manual_seed(hash((self.seed, self.calls, *offset)) % 2**63)
        if local.dtype.itemsize == 1:  # FP8 (a PEFT run's base until it is read): no normal_ kernel, drawn in fp32
            local.copy_(torch.empty(local.shape, device=local.device).normal_(0.0, std, generator=generator))
        else:
            local.normal_(0.0, std, generator=generator)


def materialize(model: GLM46ForCausalLM, device: torch.device | str, seed: int | None = None) -> GLM46ForCausalLM:
    """Allocate the shards of a meta-device model on `device` and initialise them; returns the model. `seed`
    defaults to torch's initial seed, which `seed_everything` sets alike on every rank."""
    model.to_empty(device=device)
    model.init_weights(normal_=ShardedNormal(torch.initial_seed() if seed is None else seed))
    return model
