"""GLM46ForCausalLM: the GLM-4.5/4.6 decoder, its MTP layers, an untied lm_head, and KV-cache generation.

Parameter names follow transformers' in-memory Glm4Moe layout (`model.layers.N.mlp.experts.gate_up_proj`,
...), so HF import/export (glm46.checkpoint.hub_keys) is a renaming plus the per-expert split of the Hub files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .attention import Documents
from .config import GLM46Config
from .decoder import DecoderLayer
from .experts import GroupedExperts
from .generation import DecodingRows, KVCache, distinct_rows, sample_next_token
from .layers import RMSNorm, RotaryEmbedding
from .loss import IGNORE_INDEX, chunk_tokens, chunked_cross_entropy, shift_labels
from .mtp import MTPLayer
from .router import TopkRouter
from .token_split import WHOLE_ROWS, TokenSplit


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None = None  # [B, T, V]; None when a loss was asked for
    mtp_logits: list[torch.Tensor] = field(default_factory=list)  # depth k: [B, T, V], position i predicts i+k+1
    loss: torch.Tensor | None = None  # mean next-token CE over labelled tokens
    mtp_loss: torch.Tensor | None = None  # mean over MTP depths of their CE
    expert_counts: torch.Tensor | None = None  # [MoE layers (main, then MTP), E] tokens routed to each expert
    balance_loss: torch.Tensor | None = None  # sequence-wise balance loss summed over MoE layers (unweighted)
    hidden_states: torch.Tensor | None = None  # a pipeline stage before the last: what it sends on [B, T, hidden]
    mtp_embeds: list[torch.Tensor] = field(default_factory=list)  # and the MTP depths' token embeddings, sent with it


def _normal_(tensor: torch.Tensor, std: float) -> None:
    nn.init.normal_(tensor, mean=0.0, std=std)


OWN_INIT = (GroupedExperts, TopkRouter, RMSNorm, RotaryEmbedding)  # modules with an init_weights(std, normal_)


@torch.no_grad()
def initialize(
    modules: Iterable[nn.Module], std: float, normal_: Callable[[torch.Tensor, float], None] = _normal_
) -> None:
    """transformers' Glm4Moe initialisation: N(0, std) weights, zero biases, unit norms, in `modules` order. torch's
    layers are initialised here, glm46's own by their `init_weights` (OWN_INIT). `normal_(tensor, std)` draws in
    place (glm46.parallel.materialize passes one that draws sharded weights). A layer's registered weight is drawn:
    its `weight` attribute may be computed from it (glm46.peft's trainable token rows)."""
    for module in modules:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            normal_(module._parameters["weight"], std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, OWN_INIT):
            module.init_weights(std, normal_)


def positions_after(cache: KVCache | None, input_ids: torch.Tensor) -> torch.Tensor:
    """Position ids [B, T] of input_ids placed after the tokens already in the cache."""
    start = cache.length if cache is not None else 0
    positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
    return positions.unsqueeze(0).expand(input_ids.shape[0], -1)


def left_padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """attention_mask [B, T] (1 real, 0 left padding) -> position ids [B, T] counted from each row's first real token
    (pads at 0), as transformers does: a padded prompt then continues exactly as it would alone."""
    mask = attention_mask.long()
    if bool((mask.diff(dim=-1) < 0).any()):
        raise ValueError("generate expects left padding: attention_mask has a 0 after a 1 in a row")
    if not bool(mask[:, -1].all()):
        raise ValueError("generate needs a real token in every row: attention_mask has a row of padding only")
    return (mask.cumsum(dim=-1) - 1).clamp(min=0)


def run_layers(
    layers: Iterable[DecoderLayer],
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: KVCache | None = None,
    documents: Documents | None = None,
) -> tuple[torch.Tensor, list]:
    """h [B, T, hidden] through `layers` in order -> (h, routing stats of the MoE layers among them)."""
    stats = []
    for layer in layers:
        h, layer_stats = layer(h, cos, sin, cache, documents)
        if layer_stats is not None:
            stats.append(layer_stats)
    return h, stats


class GLM46Model(nn.Module):
    """Embedding, decoder layers and final norm. A pipeline stage keeps only its own parts (glm46.parallel.
    pipeline_parallel): without the embedding it takes hidden states, without the norm it returns them unnormed."""

    def __init__(self, config: GLM46Config, layer_ids: Iterable[int] | None = None):
        """layer_ids: the decoder layers to build (all by default)."""
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # Keyed by index, as torchtitan's models: a pipeline stage keeps only its own layers, under the same names.
        ids = range(config.num_hidden_layers) if layer_ids is None else layer_ids
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i) for i in ids})
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta)

    def embed(self, input_ids: torch.Tensor, split: TokenSplit = WHOLE_ROWS) -> torch.Tensor:
        """Token ids of the whole rows [B, T] -> the embeddings this rank's layers run on [B, T', hidden]."""
        return split.scatter(self.embed_tokens(split.inputs(input_ids)))

    def forward(
        self,
        inputs: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache | None = None,
        documents: Documents | None = None,
        split: TokenSplit = WHOLE_ROWS,
    ) -> tuple[torch.Tensor, list]:
        """inputs: token ids [B, T] (hidden states [B, T', hidden] on a pipeline stage without the embedding),
        position_ids [B, T] -> final-normed hidden [B, T', hidden] (T' = this rank's part of T under a token
        split), routing stats per MoE layer.
        documents: `Documents.from_positions(position_ids)` for rows of packed documents, else None."""
        h = inputs if self.embed_tokens is None else self.embed(inputs, split)
        cos, sin = self.rotary_emb(split.inputs(position_ids), h.dtype)  # of its tokens: attention sees all rows
        h, stats = run_layers(self.layers.values(), h, cos, sin, cache, documents)
        if cache is not None:
            cache.advance(position_ids.shape[1])
        return (h if self.norm is None else self.norm(h)), stats


def total_loss(out: CausalLMOutput, mtp_weight: float, balance_alpha: float) -> torch.Tensor:
    """GLM-4.5's objective: CE + mtp_weight x MTP CE + alpha x sequence-wise balance loss, of the terms present."""
    loss = out.loss
    if out.mtp_loss is not None:
        loss = loss + mtp_weight * out.mtp_loss
    if out.balance_loss is not None:
        loss = loss + balance_alpha * out.balance_loss
    return loss


class GLM46ForCausalLM(nn.Module):
    def __init__(self, config: GLM46Config, layer_ids: Iterable[int] | None = None):
        """layer_ids: the decoder layers to build (all by default; a pipeline stage's parts, glm46.parallel.
        pipeline_parallel.stage_part, are built without any and take the model's own)."""
        super().__init__()
        self.config = config
        self.model = GLM46Model(config, layer_ids)
        self.mtp_layers = nn.ModuleList(MTPLayer(config, k) for k in range(1, config.num_nextn_predict_layers + 1))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.loss_chunk_size = chunk_tokens(config.vocab_size)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    def init_weights(self, modules: Iterable[nn.Module] | None = None, normal_=_normal_) -> None:
        initialize(self.modules() if modules is None else modules, self.config.initializer_range, normal_)

    def is_whole(self) -> bool:
        """Whether every part of the model is here; a pipeline stage's model leaves out the embedding, the head
        (final norm, MTP layers, lm_head) or decoder layers (glm46.parallel.pipeline_parallel.split_model)."""
        inner = self.model
        parts = (inner.embed_tokens, inner.norm, self.lm_head)
        return all(p is not None for p in parts) and len(inner.layers) == self.config.num_hidden_layers

    def routers(self) -> list[TopkRouter]:
        """The routers in the order of `expert_counts`: main-model MoE layers, then MTP layers."""
        blocks = [*self.model.layers.values(), *(mtp.block for mtp in self.mtp_layers)]
        return [block.mlp.gate for block in blocks if block.is_moe]

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        *,
        mtp_embeds: Sequence[torch.Tensor] = (),
        split: TokenSplit = WHOLE_ROWS,
        label_counts: tuple[torch.Tensor, Sequence[torch.Tensor]] | None = None,
        keep_logits: bool = True,
    ) -> CausalLMOutput:
        """input_ids [B, T]; labels [B, T] are next-token targets aligned with the inputs (labels[:, i] is
        token i+1; -100 for none). With labels, returns losses and no logits; otherwise full logits.
        MTP runs when there is no cache (training, scoring), not during generation. In rows of packed documents
        (position ids restarting at 0) attention stays within a document, and so do the MTP targets: depth k has
        none at position i when token i+k+1 is in a later document (its mtp_logits there predict nothing).

        A pipeline stage (glm46.parallel.pipeline_parallel) is this model with parts left out: without the
        embedding, input_ids are the hidden states the stage before sent and mtp_embeds the MTP depths' token
        embeddings; without the final norm the output holds what the next stage takes (`hidden_states`,
        `mtp_embeds`). split: how the rows' tokens are split over ranks (glm46.modules.token_split; whole here by
        default; generation's rows are always whole). label_counts: the labelled tokens (main, per MTP depth) the
        losses are means over when these rows are a part of a larger batch (a pipeline microbatch); None: these
        rows'. keep_logits=False: see glm46.modules.loss.chunked_cross_entropy."""
        packed = position_ids is not None and cache is None  # rows may hold several documents
        if position_ids is None:
            position_ids = positions_after(cache, input_ids)
        documents = Documents.from_positions(position_ids) if packed else None
        hidden, stats = self.model(input_ids, position_ids, cache, documents, split)

        out = CausalLMOutput()
        if self.model.norm is None:  # a pipeline stage before the last: the first embeds the MTP depths' tokens
            if self.model.embed_tokens is not None:
                depths = range(1, self.config.num_nextn_predict_layers + 1)
                mtp_embeds = [self.model.embed(input_ids.roll(-k, dims=1), split) for k in depths]
            out.hidden_states, out.mtp_embeds = hidden, list(mtp_embeds)
        mtp_hidden, h = [], hidden
        for k, mtp in enumerate(self.mtp_layers if cache is None else [], start=1):
            # Token i+k at position i; the last k positions wrap around and have no target, nor (packed rows) the
            # positions whose token i+k+1 is in the next document: shift_labels drops both.
            embeds = mtp_embeds[k - 1] if mtp_embeds else self.model.embed(input_ids.roll(-k, dims=1), split)
            cos, sin = self.model.rotary_emb(split.inputs(position_ids) + k, embeds.dtype)
            h, mtp_stats = mtp(h, embeds, cos, sin, documents)
            mtp_hidden.append(h)
            stats.append(mtp_stats)

        if stats:
            out.expert_counts = torch.stack([s.counts for s in stats])
            out.balance_loss = torch.stack([s.balance_loss() for s in stats]).sum()
        if self.model.norm is None:
            return out
        if labels is None:
            out.logits = self.lm_head(split.gather(hidden))
            out.mtp_logits = [self.lm_head(split.gather(h)) for h in mtp_hidden]
            return out
        counts = label_counts or (None, [None] * len(mtp_hidden))
        out.loss = self._loss(hidden, labels, split, counts[0], keep_logits)
        if mtp_hidden:
            ids = documents.ids if documents is not None else None
            mtp_losses = [
                self._loss(h, shift_labels(labels, k, ids), split, count, keep_logits)
                for k, (h, count) in enumerate(zip(mtp_hidden, counts[1]), start=1)
            ]
            out.mtp_loss = torch.stack(mtp_losses).mean()
        return out

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output [B, T, hidden] without the head or MTP: for a loss computed against
        lm_head.weight outside (RL's token log-probs, in chunks). Under FSDP2 it is registered as a forward method
        (glm46.rl.grpo_module), so that the root's weights are gathered for it."""
        hidden, _ = self.model(input_ids, position_ids)
        return hidden

    def _loss(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        split: TokenSplit,
        count: torch.Tensor | None,
        keep_logits: bool,
    ) -> torch.Tensor:
        """Mean CE over the labelled tokens of `labels` (of the whole rows; or over `count` tokens), of this rank's
        tokens under a token split: its part of the mean."""
        if count is None:
            count = (labels != IGNORE_INDEX).sum().clamp(min=1)
        weight = self.lm_head.weight
        return chunked_cross_entropy(hidden, weight, split.labels(labels), self.loss_chunk_size, count, keep_logits)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = None,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        attention_mask: torch.Tensor | None = None,
        all_finished: Callable[[bool], bool] | None = None,
    ) -> torch.Tensor:
        """Continue prompts [B, T] by up to max_new_tokens with the KV cache -> [B, T + new].

        Prompts of different lengths are left-padded, with attention_mask [B, T] 1 for real tokens and 0 for padding
        (as in transformers): positions count from each row's first real token and no token attends to a pad, so a
        row continues exactly as its prompt alone would. Right padding or a row of padding only is a ValueError.
        Without a mask (or with one of all ones) every token is real and attention takes the unmasked causal path.
        temperature 0 is greedy; generator: one, or one per row (glm46.modules.generation.sample_next_token). A row
        that emits an EOS token is padded with that token afterwards (and leaves the batch with the others that ended
        once they are half of it: DecodingRows). MTP layers are not used. all_finished(this
        batch's rows all finished) -> whether every rank's are: on a model sharded over ranks, every rank must run the
        same number of forwards (their collectives pair up), so generation stops when all ranks' rows have.
        """
        batch, prompt_len = input_ids.shape
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
        # Rows that hold the same prompt (GRPO's samples of one prompt) are prefilled once and the cache copied to
        # each, as vLLM's n > 1 sampling does: 8 samples a prompt cost an eighth of the prefill.
        distinct, prompt_of_row = distinct_rows(input_ids, attention_mask)
        dtype = self.model.embed_tokens.weight.dtype
        cache = KVCache(self.config, len(distinct), prompt_len + max_new_tokens, dtype, input_ids.device)
        if attention_mask is None:
            positions = positions_after(cache, input_ids)
        else:
            positions = left_padded_positions(attention_mask)
            if not bool(attention_mask.all()):
                cache.mark_padding(attention_mask[distinct])
        eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        eos = torch.tensor(eos_ids, dtype=input_ids.dtype, device=input_ids.device)
        decoding = DecodingRows(batch, max_new_tokens, eos, generator, input_ids)
        shared = len(distinct) < batch
        step_input, positions = (input_ids[distinct], positions[distinct]) if shared else (input_ids, positions)
        for step in range(max_new_tokens):
            hidden, _ = self.model(step_input, positions, cache)  # positions: of the cache's rows
            logits = self.lm_head(hidden[:, -1])
            if step == 0 and shared:  # the distinct prompts' -> every row's
                logits, positions = logits[prompt_of_row], positions[prompt_of_row]
                cache.select(prompt_of_row)
            next_token = decoding.write(sample_next_token(logits, temperature, top_k, top_p, decoding.generator))
            done = bool(decoding.ended.all())
            if done if all_finished is None else all_finished(done):
                break
            if (keep := decoding.drop_ended(cache)) is not None:
                next_token, positions = next_token[keep], positions[keep]
            step_input, positions = next_token[:, None], positions[:, -1:] + 1  # [b, 1] each
        return torch.cat([input_ids, decoding.output()], dim=1)


def decoder_layers(model: GLM46ForCausalLM) -> list[DecoderLayer]:
    """Every decoder layer: the main model's, then each MTP layer's block (what the parallel code wraps layer by
    layer: FSDP2 units, activation checkpointing, compilation)."""
    return [*model.model.layers.values(), *(mtp.block for mtp in model.mtp_layers)]
