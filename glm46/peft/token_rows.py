"""Trainable token rows: some rows of the embedding and the lm_head train, the rest stay frozen (peft's
`trainable_token_indices`, its TrainableTokensLayer), for tokens that the base has barely seen: the chat and tool
tokens of a base model that never met a conversation, or tokens added for fine-tuning.

The rows' values (peft's `trainable_tokens_delta` [n, hidden], which holds values, not differences) start as the
base's rows and replace them: the layer reads W.index_copy(0, token_indices, rows), as peft's forward does. The
layer's class becomes a subclass whose `weight` is that merged weight (as FSDP2 puts its own subclass in a module's
place), so that every reader of `lm_head.weight` (the chunked loss, RL's and DPO's token log-probs, the MTP heads)
sees the trained rows; the base weight keeps its name and stays frozen.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from glm46.parallel.boxes import local_box, local_tensor

from .adapters import gathered
from .settings import AdapterSettings

SPECIAL = "special"  # in peft.trainable_tokens: every special token of the tokenizer


def token_indices(names: list[str], tokenizer_file: str | Path) -> list[int]:
    """The ids of `names` in a tokenizer.json, sorted; `special` stands for all its special tokens. An unknown
    token is refused, naming it and the file."""
    tokenizer = json.loads(Path(tokenizer_file).read_text())
    vocab = dict(tokenizer["model"]["vocab"])
    vocab.update({added["content"]: added["id"] for added in tokenizer.get("added_tokens", [])})
    ids = set()
    for name in names:
        if name == SPECIAL:
            ids |= {added["id"] for added in tokenizer.get("added_tokens", []) if added.get("special")}
        elif name in vocab:
            ids.add(vocab[name])
        else:
            raise ValueError(f"peft.trainable_tokens: {name!r} is not a token of {tokenizer_file}")
    return sorted(ids)


def trainable_token_ids(settings: AdapterSettings, weights: Path | None) -> list[int]:
    """settings.trainable_tokens' ids in the tokenizer.json of init_from's HF folder `weights` (none named: [])."""
    if not settings.trainable_tokens:
        return []
    if weights is None or not (weights / "tokenizer.json").is_file():
        raise ValueError(
            f"peft.trainable_tokens={list(settings.trainable_tokens)}: init_from has no tokenizer.json "
            f"({weights or 'no HF folder'}) to find the tokens in"
        )
    return token_indices(settings.trainable_tokens, weights / "tokenizer.json")


class TokenRows(nn.Module):
    """The trained rows of one embedding or lm_head: `trainable_tokens_delta` [n, hidden] (fp32) for the tokens
    `indices`; `active` False gives the base rows."""

    def __init__(self, indices: list[int], hidden: int):
        super().__init__()
        self.indices = list(indices)  # not a buffer: the run's settings give them (a meta model's buffers are empty)
        self.trainable_tokens_delta = nn.Parameter(torch.empty(len(indices), hidden))
        self.active = True
        self._on_device: torch.Tensor | None = None

    def token_indices(self, device: torch.device) -> torch.Tensor:
        if self._on_device is None or self._on_device.device != device:
            self._on_device = torch.tensor(self.indices, dtype=torch.long, device=device)
        return self._on_device

    @torch.no_grad()
    def reset_parameters(self, weight: torch.Tensor, generator: torch.Generator | None = None) -> None:
        """The base's rows (whole or sharded over the vocabulary: each rank gives the rows it holds, summed over the
        dims that shard them)."""
        rows = torch.zeros(self.trainable_tokens_delta.shape, dtype=torch.float32)
        box, local = local_box(weight), local_tensor(weight)
        indices = self.token_indices(torch.device("cpu"))
        held = (indices >= box[0].start) & (indices < box[0].stop)
        rows[held] = local[indices[held] - box[0].start].float().cpu()
        for dim, placement in enumerate(getattr(weight, "placements", ())):
            if placement.is_shard():
                dist.all_reduce(rows, group=weight.device_mesh.get_group(dim))
        local_tensor(self.trainable_tokens_delta).copy_(rows[local_box(self.trainable_tokens_delta)])

    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's part of the weight with the trained rows in place."""
        local, box = local_tensor(weight), local_box(weight)
        indices = self.token_indices(local.device)
        held = (indices >= box[0].start) & (indices < box[0].stop)
        rows = gathered(self.trainable_tokens_delta)[held.cpu()].to(local.device, local.dtype)
        return local.index_copy(0, indices[held] - box[0].start, rows[:, box[1]])


class TokenRowsWeight:
    """A layer whose `weight` is its base weight with its `adapter`'s rows in place (when it has an active one)."""

    @property
    def weight(self) -> torch.Tensor | None:
        """The weight the layer computes with. A DTensor is FSDP2's sharded storage outside a forward (the forward
        sees it gathered, a plain tensor): that is the parameter itself, which reset_parameters and merged_weight
        read by their boxes."""
        weight = self._parameters.get("weight")
        rows = self._modules.get("adapter")
        if weight is None or rows is None or not rows.active or isinstance(weight, DTensor):
            return weight
        return weight.index_copy(0, rows.token_indices(weight.device), rows.trainable_tokens_delta.to(weight.dtype))


class EmbeddingWithTokenRows(TokenRowsWeight, nn.Embedding):
    pass


class LinearWithTokenRows(TokenRowsWeight, nn.Linear):
    pass


def add_token_rows(layer: nn.Embedding | nn.Linear, indices: list[int]) -> None:
    """Train the rows `indices` of the embedding or lm_head `layer` (on its device, meta included)."""
    layer.__class__ = EmbeddingWithTokenRows if isinstance(layer, nn.Embedding) else LinearWithTokenRows
    weight = layer._parameters["weight"]
    with torch.device(weight.device):
        layer.adapter = TokenRows(indices, weight.shape[1])
