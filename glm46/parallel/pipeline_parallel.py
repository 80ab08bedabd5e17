"""Pipeline parallelism for GLM46ForCausalLM on torch.distributed.pipelining, as torchtitan's
distributed/pipeline_parallel.py does it: the meta model is split into stages first (each pipeline rank keeps only
its stages' modules, under their original names), then TP, EP, activation checkpointing and FSDP2 apply per stage
(glm46.parallel.parallelize), and a torch schedule (1F1B, Interleaved1F1B, ZBVZeroBubble, DualPipeV, GPipe) runs the
microbatches' forward and backward inside the LightningModule's training step.

Stages (`split_layers`): the decoder layers in contiguous runs; stage 0 also holds the embedding, the last stage the
final norm, the lm_head and the MTP layers. Without `parallelism.layers_per_stage` the runs balance the per-token
matmul cost (active parameters: a dense layer's MLP, an MoE layer's router, shared and top-k experts; the last
stage's lm_head and MTP layers count on it), minimising the costliest stage.

The MTP layer needs the embeddings of the tokens ahead (depth k: token i+k). Megatron, for GLM and DeepSeek-V3, keeps
a copy of the embedding on the last stage and all-reduces its gradient with stage 0's (the "embedding group"). Here
stage 0 embeds them and they travel with the hidden states, each stage passing them on: the embedding stays one
weight on one stage, its gradient arrives through the pipeline's own backward, and checkpoints need no dedup. The
cost: each point-to-point message carries (1 + MTP depths) x [b, T, hidden] instead of one, and each stage keeps
those inputs of its microbatches in flight.

One schedule runs a whole optimizer step: under gradient accumulation the step's batches are its microbatches
(glm46.parallel.model_step.PipelineStep holds them until the last), so the pipeline fills and drains once per step,
as Megatron sets its number of microbatches to global batch / (micro-batch x data parallel). The bubble is then
(pp - 1) / (v m + pp - 1) with m the step's microbatches: the production layout's 16 per batch x 4 batches (16M
tokens) 10.5%, x 16 (64M) 2.8%, against 31.9% when each batch filled and drained it. The activations in flight
grow with m only up to the schedule's steady state (1F1B and the interleaved and zero-bubble schedules start each
microbatch's backward after a bounded number of forwards: (v - 1) pp + 2 (pp - r - 1) + 1 chunks on rank r of the
interleaved one, which the production layout's first rank reaches from 24 microbatches on), except under GPipe,
which runs every forward first. One schedule is built per number of microbatches (the batch-size warm-up grows the
accumulation), each on the same stages.

Losses are summed exactly as in one process: the schedule's grad scaling is off, and each microbatch's CE (and each
MTP depth's) is divided by the labelled tokens of the whole step, its sequence-wise balance loss weighted by its
share of the step's rows (the loss is a mean over sequences). With accumulation this is the step's token mean,
which equals one process's mean of its batches' means where every batch has as many labelled tokens (pre-training's
full rows). The balance
loss of a stage without the head reaches the backward through the hidden states it sends (`_AttachLoss`, Megatron's
MoEAuxLossAutoScaler). The logged terms are summed over the pipeline ranks once per step.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from glm46.modules.attention import Documents
from glm46.modules.config import GLM46Config
from glm46.modules.decoder import DecoderLayer
from glm46.modules.loss import IGNORE_INDEX, shift_labels
from glm46.modules.model import CausalLMOutput, GLM46ForCausalLM, positions_after, total_loss
from glm46.modules.token_split import WHOLE_ROWS, TokenSplit

from .layout import PIPELINE_SCHEDULES, V_SCHEDULES, Layout
from .sharded_tokens import ShardedTokens

# ---------------------------------------------------------------- which layers each stage holds


def layer_costs(config: GLM46Config) -> tuple[list[int], int]:
    """(per decoder layer, the head's) matmul parameters one token runs through: the split's cost model."""
    with torch.device("meta"):
        layers = [DecoderLayer(config, i) for i in (0, config.num_hidden_layers - 1)]

    def active(layer: DecoderLayer) -> int:
        total = sum(p.numel() for p in layer.parameters())
        if not layer.is_moe:
            return total
        routed = sum(p.numel() for p in layer.mlp.experts.parameters())
        return total - routed + routed // config.n_routed_experts * config.num_experts_per_tok

    dense, moe = active(layers[0]), active(layers[1])
    costs = [dense if i < config.first_k_dense_replace else moe for i in range(config.num_hidden_layers)]
    mtp_depths = config.num_nextn_predict_layers
    head = (1 + mtp_depths) * config.vocab_size * config.hidden_size + mtp_depths * (moe + 2 * config.hidden_size**2)
    return costs, head


def split_layers(config: GLM46Config, stages: int, layers_per_stage: tuple[int, ...] | None = None) -> list[range]:
    """The decoder layers of each stage, in order: `layers_per_stage` when given, else the contiguous runs that
    minimise the costliest stage (the head's cost on the last one)."""
    if layers_per_stage:
        starts = [sum(layers_per_stage[:s]) for s in range(stages + 1)]
        return [range(starts[s], starts[s + 1]) for s in range(stages)]
    costs, head = layer_costs(config)
    return list(_balanced_split(tuple(costs), head, stages))


@functools.lru_cache(maxsize=16)
def _balanced_split(costs: tuple[int, ...], head: int, stages: int) -> tuple[range, ...]:
    """The dynamic programme of split_layers (O(stages x layers^2) in Python: 0.1 s for 16 stages of 93 layers, which
    the planner asks for once per pipeline rank): computed once per cost model."""
    n = len(costs)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[s][i]: (the costliest stage, the sum of squared stage costs) when stages s.. hold layers i.. (the head
    # on the last), smallest first: the costliest stage as cheap as it can be, the others as even as they can be.
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[n] * (n + 1) for _ in range(stages + 1)]
    for i in range(n):
        last = prefix[n] - prefix[i] + head
        best[stages - 1][i] = (last, last**2)
    for s in range(stages - 2, -1, -1):
        for i in range(n - (stages - s) + 1):
            for j in range(i + 1, n - (stages - s - 1) + 1):  # stage s holds layers i..j-1
                cost, (worst, squares) = prefix[j] - prefix[i], best[s + 1][j]
                candidate = (max(cost, worst), cost**2 + squares)
                if candidate < best[s][i]:
                    best[s][i], cut[s][i] = candidate, j
    bounds, i = [0], 0
    for s in range(stages - 1):
        i = cut[s][i]
        bounds.append(i)
    bounds.append(n)
    return tuple(range(bounds[s], bounds[s + 1]) for s in range(stages))


def stage_ids(layout: Layout, pp_rank: int) -> list[int]:
    """The stages pipeline rank `pp_rank` runs: one; `virtual_stages` in a loop (rank, rank + pp, ...) for the
    interleaved schedule; two in a V (rank, 2 pp - 1 - rank) for ZBVZeroBubble and DualPipeV."""
    pp = layout.pipeline_parallel
    if layout.pipeline_schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(layout.virtual_stages)]


# ---------------------------------------------------------------- the stages' forward


@dataclass
class StepTotals:
    """What each microbatch's loss terms are divided by, counted once over the whole step."""

    labelled: torch.Tensor  # tokens with a target (the main loss's mean)
    mtp_labelled: list[torch.Tensor]  # per MTP depth
    rows: int  # sequences (the balance loss is a mean over them)
    mtp_weight: float
    balance_alpha: float


class _AttachLoss(torch.autograd.Function):
    """Returns x; in backward also gives `loss` the gradient 1, so a loss computed on a stage without the head joins
    the backward through the hidden states that stage sends on (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def stage_part(model: GLM46ForCausalLM, layers: range, is_first: bool, is_last: bool) -> GLM46ForCausalLM:
    """One stage of `model` as a model of its own: the model's module objects of that stage (its decoder layers,
    the embedding on the first, the final norm, MTP layers and lm_head on the last), the others left out. It runs
    the model's own forward, which skips what is left out."""
    with torch.device("meta"):
        part = GLM46ForCausalLM(model.config, layer_ids=())
    inner = part.model
    inner.embed_tokens = model.model.embed_tokens if is_first else None
    inner.layers = nn.ModuleDict({str(i): model.model.layers[str(i)] for i in layers})
    inner.rotary_emb = model.model.rotary_emb
    inner.norm = model.model.norm if is_last else None
    part.mtp_layers = model.mtp_layers if is_last else nn.ModuleList()
    part.lm_head = model.lm_head if is_last else None
    return part


class StageModule(nn.Module):
    """A stage as torch's schedule runs it: its part of the model (`stage_part`) and the step's bookkeeping. Stage 0
    takes input_ids [b, T], every other stage the hidden states [b, T, hidden] and the MTP depths' token
    embeddings; the last stage returns the microbatch's share of the step's loss (total_loss), the others
    (hidden, *embeddings), their balance loss attached."""

    def __init__(self, part: GLM46ForCausalLM):
        super().__init__()
        self.part = part
        self.moe_layers = sum(layer.is_moe for layer in part.model.layers.values()) + len(part.mtp_layers)
        self.totals: StepTotals | None = None  # set by Pipeline before each step
        self.split_backward = False  # set by Pipeline: whether its schedule splits input and weight gradients
        self.split: TokenSplit = WHOLE_ROWS  # set by Pipeline: sequence parallelism's split of the sequence
        self.reset()

    def reset(self) -> None:
        # Per forward call: CE, MTP CE, balance loss (unweighted), and expert counts [this stage's MoE layers, E].
        # On its first step torch's stage also runs one forward to learn the shapes it sends (on placeholder
        # inputs after stage 0): `results` keeps only the schedule's microbatches, the last calls.
        self.calls: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def results(self, microbatches: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This step's loss terms and expert counts, summed over its microbatches."""
        calls = self.calls[-microbatches:]
        terms = torch.stack([terms for terms, _ in calls]).sum(0)
        counts = None if calls[0][1] is None else torch.stack([counts for _, counts in calls]).sum(0)
        return terms, counts

    def forward(self, x: torch.Tensor, *embeds: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor):
        totals, terms = self.totals, torch.zeros(3)
        out = self.part(
            x,
            labels,
            position_ids,
            mtp_embeds=embeds,
            split=self.split,
            label_counts=(totals.labelled, totals.mtp_labelled),
            keep_logits=not self.split_backward,  # the weights' gradients come in a second backward pass
        )
        counts = None
        if out.balance_loss is not None:  # weighted by the microbatch's share of the batch's sequences
            out.balance_loss = out.balance_loss * (x.shape[0] / totals.rows)
            terms[2], counts = out.balance_loss.detach().float().cpu(), out.expert_counts.detach()
        self.calls.append((terms, counts))
        if out.hidden_states is None:  # the last stage
            terms[0] = out.loss.detach().float().cpu()
            if out.mtp_loss is not None:
                terms[1] = out.mtp_loss.detach().float().cpu()
            return total_loss(out, totals.mtp_weight, totals.balance_alpha)
        x = out.hidden_states
        if out.balance_loss is not None:
            x = _AttachLoss.apply(x, out.balance_loss * totals.balance_alpha)
        # A stage's outputs must be tensors of their own: views for the 1F1B family; copies under the schedules
        # that split the backward, which detach outputs in place once their input gradients are taken (views
        # refuse): the hidden states' original is then freed, each MTP embedding costs one more copy in flight.
        if self.split_backward:
            return (x.clone(), *(e.clone() for e in out.mtp_embeds))
        return (x, *(e.view_as(e) for e in out.mtp_embeds))


def split_model(model: GLM46ForCausalLM, layout: Layout, pp_rank: int) -> list[StageModule]:
    """Keep only the modules of `pp_rank`'s stages in `model` (in place, names unchanged; meant for the meta
    device, before the model is laid out) and return those stages, in stage order."""
    ranges = split_layers(model.config, layout.num_stages, layout.layers_per_stage)
    mine = sorted(stage_ids(layout, pp_rank))
    last = layout.num_stages - 1
    keep = {str(i) for s in mine for i in ranges[s]}
    for name in [name for name in model.model.layers if name not in keep]:
        del model.model.layers[name]
    if 0 not in mine:
        model.model.embed_tokens = None
    if last not in mine:
        model.model.norm, model.lm_head, model.mtp_layers = None, None, nn.ModuleList()
    return [StageModule(stage_part(model, ranges[s], s == 0, s == last)) for s in mine]


# ---------------------------------------------------------------- the schedule


def _loss_is_output(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output  # the last stage already returns the microbatch's share of the step's loss


class Pipeline:
    """This rank's stages and the schedule that runs them; `step` runs one batch's forward (and backward)."""

    def __init__(
        self,
        stage_models: list[StageModule],
        layout: Layout,
        mesh: DeviceMesh,
        device: torch.device,
        split: ShardedTokens | None = None,
    ):
        """split: sequence parallelism's split of the sequence (glm46.parallel.sharded_tokens), None without it."""
        from torch.distributed import pipelining

        self.models, self.layout, self.split = stage_models, layout, split
        self.group = mesh["pp"].get_group()
        ids = sorted(stage_ids(layout, mesh["pp"].get_local_rank()))
        self.stages = [
            pipelining.PipelineStage(model, index, layout.num_stages, device, group=self.group)
            for model, index in zip(stage_models, ids)
        ]
        self.schedules = {}  # number of microbatches -> the schedule that runs them
        for model in stage_models:
            model.split_backward = layout.pipeline_schedule in V_SCHEDULES
            model.split = split or WHOLE_ROWS
        self.has_first = ids[0] == 0
        self.stage_ids = ids
        self.config = stage_models[0].part.config

    def schedule(self, microbatches: int):
        """The layout's schedule over `microbatches` (built on first use, on this rank's stages)."""
        if microbatches not in self.schedules:
            from torch.distributed import pipelining

            schedule = getattr(pipelining, f"Schedule{self.layout.pipeline_schedule}")
            single = PIPELINE_SCHEDULES[self.layout.pipeline_schedule] == 1
            self.schedules[microbatches] = schedule(
                self.stages[0] if single else self.stages,
                n_microbatches=microbatches,
                loss_fn=_loss_is_output,
                scale_grads=False,  # each microbatch's loss is already its share of the step's
            )
        return self.schedules[microbatches]

    def step(
        self, batch: dict[str, torch.Tensor], totals: StepTotals, microbatches: int, train: bool = True
    ) -> CausalLMOutput:
        """Forward (and with `train` backward) of `batch` in `microbatches`; the loss terms, summed over the
        pipeline's ranks, and this rank's expert counts (its MoE layers, in the model's order)."""
        for model in self.models:
            model.totals = totals
            model.reset()
        input_ids, labels = batch["input_ids"], batch["labels"]
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = positions_after(None, input_ids)
        args = (input_ids,) if self.has_first else ()
        schedule = self.schedule(microbatches)
        run = schedule.step if train else schedule.eval
        # torch hands `target` to the loss function, which needs none here (the last stage computes the loss from
        # the `labels` keyword every stage receives), but its schedules index it per microbatch: it must be given.
        with warnings.catch_warnings():
            # FSDP2 warns of any view a wrapped module returns, as an in-place op on it would skip its hooks: the
            # 1F1B family's stages return views (see StageModule.forward) that nothing writes in place.
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPStageModule\) returned a view")
            run(*args, target=labels, return_outputs=False, position_ids=position_ids, labels=labels)
        results = [model.results(microbatches) for model in self.models]
        terms = torch.stack([terms for terms, _ in results]).sum(0)
        dist.all_reduce(terms, group=self.group)  # the head's terms live on the last stage, balance on all
        if self.split is not None:  # and each is a part per TP rank under sequence parallelism
            terms = self.split.sum(terms)
        counts = [counts for _, counts in results if counts is not None]
        out = CausalLMOutput(loss=terms[0], expert_counts=torch.cat(counts) if counts else None)
        if self.config.num_nextn_predict_layers:
            out.mtp_loss = terms[1]
        if self.config.has_moe:
            out.balance_loss = terms[2]
        return out

    def whole_model_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-MoE-layer rows of this rank's layers (expert counts, in the model's order) -> those of every stage,
        in the whole model's order, on every pipeline rank (for logging: MaxVio and expert load of all layers)."""
        mine = dict(zip(self.stage_ids, rows.split([model.moe_layers for model in self.models])))
        parts = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, {stage: part.cpu() for stage, part in mine.items()}, group=self.group)
        stages = {stage: part for gathered in parts for stage, part in gathered.items()}
        return torch.cat([stages[s] for s in sorted(stages)]).to(rows.device)


def step_totals(batch: dict[str, torch.Tensor], config: GLM46Config, mtp_weight: float, alpha: float) -> StepTotals:
    """The normalisers of one step's batch (labels already masked with IGNORE_INDEX)."""
    labels, position_ids = batch["labels"], batch.get("position_ids")
    documents = Documents.from_positions(position_ids) if position_ids is not None else None
    ids = documents.ids if documents is not None else None
    depths = range(1, config.num_nextn_predict_layers + 1)
    return StepTotals(
        labelled=(labels != IGNORE_INDEX).sum().clamp(min=1),
        mtp_labelled=[(shift_labels(labels, k, ids) != IGNORE_INDEX).sum().clamp(min=1) for k in depths],
        rows=labels.shape[0],
        mtp_weight=mtp_weight,
        balance_alpha=alpha,
    )
