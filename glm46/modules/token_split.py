"""How the tokens of a forward are split over ranks, as the model meets the split: an argument the caller passes to
GLM46ForCausalLM.forward (glm46.parallel.sharded_tokens builds the parallel ones), never state the model holds.

Context parallelism gives each rank some chunks of every row from the embedding on; sequence parallelism splits the
residual stream between the tensor-parallel regions. The model calls these four steps where its tensors cross
the split; what happens inside a layer (attention over the whole rows, the MoE's counts over them) the parallel
code installs on the layers themselves.
"""

import torch


class TokenSplit:
    """No split: every token of the rows is on this rank, and each step returns its input."""

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor every rank holds whole, of the rows' tokens (ids, positions) [B, T, ...] -> this rank's tokens."""
        return x

    def scatter(self, h: torch.Tensor) -> torch.Tensor:
        """The embeddings of those tokens [B, T', hidden] -> the part of them this rank's layers run on."""
        return h

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The whole rows' targets [B, T] -> those of the tokens whose final hidden states are on this rank."""
        return labels

    def gather(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's final hidden states -> the whole rows', for their logits."""
        return h


WHOLE_ROWS = TokenSplit()
