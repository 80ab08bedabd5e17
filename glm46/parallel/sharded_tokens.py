"""The token split of context and sequence parallelism, as the model and the training step meet it.

`ShardedTokens` is the glm46.modules.token_split.TokenSplit that GLM46ForCausalLM.forward takes under these layouts:
context parallelism's chunks of every row from the embedding on (glm46.parallel.context_parallel), then sequence
parallelism's split of the residual stream over the TP ranks (glm46.parallel.sequence_parallel). Inside the layers
the parallel code installs its own parts: context parallelism's attention (apply_context_parallel) and
`sum_routing_over`, the MoE layers' forward hook that counts the experts' tokens over the whole rows.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from glm46.modules.moe import MoE, RoutingStats
from glm46.modules.token_split import TokenSplit

from .context_parallel import ContextShards
from .layout import Layout
from .sequence_parallel import SequenceShards


class ShardedTokens(TokenSplit):
    """The rows' tokens split over the cp ranks (context), then each cp rank's over the TP ranks (sequence)."""

    def __init__(self, context: ContextShards | None, sequence: SequenceShards | None):
        self.context, self.sequence = context, sequence

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.context is None else self.context.local(x)

    def scatter(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.sequence is None else self.sequence.scatter(h)

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        labels = self.inputs(labels)
        return labels if self.sequence is None else self.sequence.local(labels)

    def gather(self, h: torch.Tensor) -> torch.Tensor:
        for split in (self.sequence, self.context):  # innermost split first
            h = h if split is None else split.gather(h)
        return h

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """A term each rank holds its tokens' part of (a loss, a count) -> the whole rows' (detached)."""
        value = value.detach()
        for split in (self.sequence, self.context):
            value = value if split is None else split.sum(value)
        return value

    @property
    def context_size(self) -> int:
        return 1 if self.context is None else self.context.size


def token_split(layout: Layout, mesh: DeviceMesh) -> ShardedTokens | None:
    """The layout's split of the rows' tokens over `mesh` (glm46.parallel.mesh.build_mesh); None: none."""
    context = ContextShards(mesh["cp"].get_group()) if layout.context_parallel > 1 else None
    sequence = SequenceShards(mesh["tp"].get_group()) if layout.sequence_parallel else None
    return None if context is None and sequence is None else ShardedTokens(context, sequence)


def sum_routing_over(split: ShardedTokens):
    """A forward hook for MoE layers that see this rank's tokens only: their expert counts and selections summed
    over the ranks (context, then sequence), their tokens per row those of the whole rows, so that the balancer
    counts every token and the ranks' sequence-wise balance losses sum to the whole one."""
    parts = [s for s in (split.context, split.sequence) if s is not None]
    ways = math.prod(s.size for s in parts)

    def hook(module: nn.Module, args, output: tuple[torch.Tensor, RoutingStats]):
        out, stats = output
        counts, selections = stats.counts, stats.selections
        for part in parts:
            counts, selections = part.sum(counts), part.sum(selections)
        return out, stats._replace(counts=counts, selections=selections, tokens=stats.tokens * ways)

    return hook


def install_routing_sums(model: nn.Module, split: ShardedTokens) -> None:
    """sum_routing_over on every MoE layer of `model`."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.register_forward_hook(sum_routing_over(split))
