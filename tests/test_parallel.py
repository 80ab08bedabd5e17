"""Every parallel layout against the single-process run, through the real Lightning Trainer with gloo on CPU.

Each run is `main(spec)` on its ranks, started as torchrun or srun starts them (tests.ranks: one process per rank,
Lightning told its rank by the environment); run.py's own multi-process runs (tests/test_resume.py and others) go
through Lightning's launcher. The strategy comes from the layout's conf/parallelism/*.yaml,
composed as run.py composes it. Every run starts from the same HF checkpoint through `init_from`: the mesh
layouts build the model on the meta device and each rank reads only its slices (random init differs by
layout). For a fixed global batch, the per-step loss (averaged over the data-parallel ranks) and the final
full weights must equal the single-process run within 1e-5 relative (fp32, Muon with fp32 Newton-Schulz,
gradient clipping and the expert balancer on).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH, SEQ_LEN, STEPS = 4, 16, 3
TOLERANCE = 1e-5
# AdamW's eps (Muon's AdamW groups too). Some gradients are tiny sums of cancelling terms (embedding rows of
# rare tokens, q/k biases under QK-norm); AdamW divides by their own magnitude, so with eps=1e-8 their
# rounding noise, which differs with any change of reduction order, becomes an O(lr) step. eps=1e-5 keeps
# the comparison about the layouts (measured: worst tensor 8e-7 instead of 1e-5 under TP).
EPS = 1e-5


# ---------------------------------------------------------------- the script each run executes


def compose_layout(layout: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from glm46.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=[f"parallelism={layout}", *overrides])


def samples(vocab_size: int, count: int, packed: bool = False) -> list[dict[str, torch.Tensor]]:
    """Rows of one document; `packed`: of two, split at 3 to 11 (so across a sequence-parallel split of 16 into
    2 x 8, or not), positions restarting at the second and no target for the first's last token."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab_size, (count, SEQ_LEN + 1), generator=generator)
    rows = []
    for i, t in enumerate(tokens):
        positions, mask = torch.arange(SEQ_LEN), torch.ones(SEQ_LEN, dtype=torch.long)
        if packed:
            split = 3 + i % 9
            positions = torch.cat([torch.arange(split), torch.arange(SEQ_LEN - split)])
            mask[split - 1] = 0
        rows.append({"input_ids": t[:-1], "labels": t[1:], "position_ids": positions, "loss_mask": mask})
    return rows


def main(spec: dict) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from glm46.hf import save_hf
    from glm46.lit import GLM46LitModule
    from glm46.lit.callbacks import ExpertBalancer
    from glm46.lit.guard import StepGuard
    from glm46.lit.strategies import build_strategy
    from glm46.optim import Muon, Piecewise, WarmupCosine
    from glm46.parallel import Layout, data_parallel_group
    from glm46.parallel.layout import model_problems
    from glm46.parallel.state import full_state_items, is_writer
    from glm46.peft import AdapterSettings
    from tests.helpers import tiny_config

    devices = spec.get("devices", 1)
    cfg = compose_layout(spec["layout"], spec.get("overrides", []))
    config = tiny_config(**spec.get("model", {}))
    optimizer = spec.get("optimizer", "muon")
    layout = Layout.from_config(cfg.parallelism, devices)
    assert not model_problems(layout, config)
    steps = spec.get("steps", STEPS)

    torch.manual_seed(0)
    lr, eps = spec.get("lr", 3e-3), spec.get("eps", EPS)
    factory = (
        functools.partial(Muon, lr=lr, eps=eps, ns_dtype=torch.float32)
        if optimizer == "muon"
        else functools.partial(torch.optim.AdamW, lr=lr, weight_decay=0.1, eps=eps)
    )
    module = GLM46LitModule(
        config,
        optimizer=factory,
        lr_schedule=WarmupCosine(
            warmup_tokens=0, total_tokens=4 * GLOBAL_BATCH * SEQ_LEN, min_factor=0.1
        ),  # driven by tokens seen: TP must not double them
        mtp_weight=Piecewise(values=[0.3], boundaries=[]),
        empty_init=cfg.parallelism.engine == "mesh",
        init_from=spec["init_from"],
        guard=StepGuard(warmup_steps=1, max_bad_steps=3) if "nan_gradient_at" in spec else None,
        peft=AdapterSettings(**spec["peft"]) if "peft" in spec else None,
    )
    data = samples(config.vocab_size, 8 * GLOBAL_BATCH, spec.get("packed", False))

    class GlobalBatches(L.LightningDataModule):
        """Step s of the run takes global samples [s * G, (s + 1) * G); data-parallel rank r of D the r-th
        G / D of them: the same global batch for every layout, resumable at the restored step."""

        def train_dataloader(self):
            kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
            rank, size = kwargs.get("rank", 0), kwargs.get("num_replicas", 1)
            per_rank = GLOBAL_BATCH // size
            start = self.trainer.global_step
            indices = [s * GLOBAL_BATCH + rank * per_rank + i for s in range(start, 8) for i in range(per_rank)]
            batch_size = per_rank // spec.get("accumulate", 1)  # a step's rows in that many batches
            return DataLoader([data[i] for i in indices], batch_size=batch_size, shuffle=False)

    class Record(L.Callback):
        def __init__(self):
            self.losses, self.grad_norms, self.initial, self.step = [], [], None, 0

        def on_train_start(self, trainer, pl_module):  # the weights init_from gave, gathered on rank 0
            self.step = trainer.global_step  # where this run (or its resume) starts
            self.initial = {name: None if t is None else t.clone() for name, t in full_state_items(pl_module.model)}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == self.step:
                return  # inside an accumulation: a pipeline logs its step's loss at the step's last batch
            self.step = trainer.global_step
            # The step's loss as logged: whole (a sequence-parallel rank returns its tokens' part for the backward)
            loss = trainer.callback_metrics["train/total_loss"].detach().clone()
            group = data_parallel_group(trainer.strategy)
            self.losses.append(float(trainer.strategy.reduce(loss, group=group, reduce_op="mean")))
            # Before clipping: the gradients' scale. Not under ZeRO-3, whose parameters hold placeholders outside its
            # gathering contexts (the norm over them reads 0)
            norm = trainer.callback_metrics.get("optim/grad_norm")
            deepspeed = cfg.parallelism.engine == "deepspeed"
            self.grad_norms.append(None if norm is None or deepspeed else float(norm))

    record = Record()

    class NanGradient(L.Callback):
        """A NaN in the first gradient this rank holds at step `nan_gradient_at`: the guard must skip the step."""

        def on_after_backward(self, trainer, pl_module):
            if trainer.global_step == spec["nan_gradient_at"]:
                grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
                (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")

    checkpoints = []
    if spec.get("checkpoint_every"):  # checkpoints every that many steps, in the layout's own format
        from lightning.pytorch.callbacks import ModelCheckpoint

        checkpoints.append(
            ModelCheckpoint(
                dirpath=spec["out"],
                filename="step{step}",
                save_top_k=-1,
                every_n_train_steps=spec["checkpoint_every"],
                auto_insert_metric_name=False,
            )
        )
    balancer = ExpertBalancer(rate=Piecewise(values=[0.01], boundaries=[]), history_every=1, history_file=None)
    strategy = build_strategy(cfg.parallelism, layout)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision=spec.get("precision", "32-true"),
        max_steps=steps,
        accumulate_grad_batches=spec.get("accumulate", 1),
        gradient_clip_val=spec.get("clip", 1.0),
        logger=False,
        enable_checkpointing=bool(checkpoints),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[record, balancer, *checkpoints, *([NanGradient()] if "nan_gradient_at" in spec else [])],
    )
    trainer.fit(module, datamodule=GlobalBatches(), ckpt_path=spec.get("resume"))
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    state = {name: None if t is None else t.clone() for name, t in full_state_items(module.model)}  # whole on rank 0
    merged = None
    if "peft" in spec:  # the adapters folded in, as the merged export and RL's weight pushes take them
        from glm46.peft import is_adapter_name
        from glm46.peft.merge import merged_weights

        with merged_weights(module.model):
            items = full_state_items(module.model)  # whole on rank 0, None elsewhere
            merged = {n: None if t is None else t.clone() for n, t in items if not is_adapter_name(n)}
    biases = {n: b for n, b in module.model.named_buffers() if n.endswith("e_score_correction_bias")}
    if torch.distributed.is_initialized():  # every rank holding a router must have applied the same bias updates
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, biases)
        for other in gathered:
            assert all(torch.equal(other[n], biases[n]) for n in other.keys() & biases.keys()), "ranks disagree"
    experts = [*module.model.model.layers.values()][-1].mlp.experts
    expert_parallel = torch.distributed.get_world_size(experts.group) if hasattr(experts, "group") else 1
    weight = experts.gate_up_proj
    # DeepSpeed's ZeRO-3 parameters are empty placeholders (numel 0) outside its gathering contexts: not counted
    expert_share = weight.to_local().numel() / weight.numel() if hasattr(weight, "to_local") else None
    if spec.get("hf"):
        save_hf(module.model, out / "hf")  # every rank; rank 0 writes
    if is_writer():
        torch.save(
            {
                "losses": record.losses,
                "grad_norms": record.grad_norms,
                "state": state,
                "merged": merged,
                "initial": record.initial,
                "tokens_seen": module.tokens_seen,
                "counts": [counts for _, counts in balancer.history],
                "expert_parallel": expert_parallel,
                "expert_share": expert_share,  # the share of the experts rank 0 holds
                "world_size": trainer.world_size,
                "skipped_steps": module.guard.skipped if module.guard is not None else 0,
                # a pipeline's schedules, by the microbatches each ran
                "schedules": sorted(getattr(getattr(module.model_step, "pipeline", None), "schedules", {})),
            },
            out / "result.pt",
        )


# ---------------------------------------------------------------- helpers for the tests


@pytest.fixture(scope="session")
def initial_weights(tmp_path_factory) -> str:
    """One HF checkpoint every run starts from: random N(0, 0.1) weights, norms in (0.5, 1.5), non-zero biases
    and correction biases, so nothing left at 0 or 1 can hide a mismatch."""
    from glm46.hf import save_hf
    from tests.helpers import random_model, tiny_config

    return str(save_hf(random_model(tiny_config(), seed=0), tmp_path_factory.mktemp("initial") / "hf"))


def run_layout(tmp_path: Path, layout: str, devices: int = 1, *, init_from: str, timeout: int = 600, **spec) -> dict:
    out = tmp_path / f"{layout}-{devices}"
    out.mkdir(parents=True, exist_ok=True)
    spec = {"layout": layout, "devices": devices, "out": str(out), "init_from": init_from, **spec}
    from tests.ranks import run_ranks

    run_ranks(main, spec, world_size=devices, logs=out / "logs", timeout=timeout)
    return torch.load(out / "result.pt", weights_only=False) | {"out": out}


def assert_same_run(
    run: dict, reference: dict, tolerance: float = TOLERANCE, first_step: int = 0, weight_tolerance: float | None = None
) -> None:
    """Losses (from `first_step` on, for a resumed run), global expert counts, tokens seen and final weights (to
    `weight_tolerance`, by default `tolerance`)."""
    expected = reference["losses"][first_step:]
    assert len(run["losses"]) == len(expected)
    for step, (a, b) in enumerate(zip(run["losses"], expected), start=first_step):
        assert abs(a - b) <= tolerance * abs(b), f"step {step}: loss {a} vs single-process {b}"
    # Muon's update and Adam's hardly see a gradient's scale: the norms before clipping do
    for step, (a, b) in enumerate(zip(run["grad_norms"], reference["grad_norms"][first_step:]), start=first_step):
        if a is not None and b is not None and not (math.isnan(a) and math.isnan(b)):  # a skipped step's NaN
            assert abs(a - b) <= tolerance * abs(b), f"step {step}: gradient norm {a} vs single-process {b}"
    assert len(run["counts"]) == len(reference["counts"])
    for step, (a, b) in enumerate(zip(run["counts"], reference["counts"])):
        assert torch.equal(a, b), f"step {step}: global expert counts differ from the single-process run"
    assert run["tokens_seen"] == reference["tokens_seen"]
    assert run["state"].keys() == reference["state"].keys()
    errors = {
        name: ((run["state"][name].float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()
        for name, b in reference["state"].items()
    }
    worst = max(errors, key=errors.get)
    bound = weight_tolerance or tolerance
    assert errors[worst] <= bound, f"final {worst} differs from the single-process run by {errors[worst]:.2e}"


def assert_weights_of_checkpoint(path: Path, state: dict[str, torch.Tensor]) -> None:
    """`init_from=<sharded checkpoint folder>` (glm46.parallel.state.load_weights) gives these weights."""
    from glm46.checkpoint.weights import load_weights
    from glm46.modules import GLM46ForCausalLM
    from tests.helpers import tiny_config

    model = GLM46ForCausalLM(tiny_config())
    load_weights(model, path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def assert_loads_and_exports_like_one_process(run: dict, init_from: str, tmp_path: Path) -> None:
    """The sharded run's weights right after `init_from` equal one process's load_hf of that directory, and its
    hf/ export (assembled one Hub tensor at a time) equals one process's export of its final weights, file for
    file and tensor for tensor."""
    from safetensors import safe_open

    from glm46.hf import load_hf, save_hf
    from glm46.modules import GLM46ForCausalLM
    from tests.helpers import tiny_config

    for name, tensor in load_hf(init_from).state_dict().items():
        assert torch.equal(run["initial"][name], tensor), f"{name} after init_from differs from load_hf"
    single = GLM46ForCausalLM(tiny_config())
    single.load_state_dict(run["state"])
    reference = save_hf(single, tmp_path / "single-export")
    sharded = run["out"] / "hf"
    files = sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in sharded.iterdir()) == files
    assert (sharded / "config.json").read_text() == (reference / "config.json").read_text()
    for file in (f for f in files if f.endswith(".safetensors")):
        with safe_open(reference / file, "pt") as expected, safe_open(sharded / file, "pt") as written:
            assert list(written.keys()) == list(expected.keys())
            for key in expected.keys():
                assert torch.equal(written.get_tensor(key), expected.get_tensor(key)), key


# ---------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def single_muon(tmp_path_factory, initial_weights):
    return run_layout(tmp_path_factory.mktemp("single"), "single", init_from=initial_weights)


@pytest.fixture(scope="module")
def single_adamw(tmp_path_factory, initial_weights):
    return run_layout(tmp_path_factory.mktemp("single_adamw"), "single", init_from=initial_weights, optimizer="adamw")


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_equals_the_single_process_run(tmp_path, initial_weights, single_muon):
    assert_same_run(run_layout(tmp_path, "ddp", init_from=initial_weights, devices=2), single_muon)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_with_muon_equals_the_single_process_run(tmp_path, initial_weights, single_muon):
    """Muon on FSDP2 shards: each matrix is gathered for Newton-Schulz, each rank keeps its slice."""
    run = run_layout(tmp_path, "fsdp2", init_from=initial_weights, devices=2)
    assert_same_run(run, single_muon)


@pytest.mark.distributed
@pytest.mark.slow
def test_expert_parallel_equals_the_single_process_run_and_exports_to_transformers(
    tmp_path, initial_weights, single_muon
):
    from transformers import AutoModelForCausalLM

    from glm46.hf import load_hf
    from glm46.modules import GLM46ForCausalLM
    from tests.helpers import tiny_config

    run = run_layout(tmp_path, "ep", init_from=initial_weights, devices=2, hf=True)
    assert run["expert_parallel"] == 2, "the experts must be split over 2 ranks"
    assert_same_run(run, single_muon)

    exported = load_hf(run["out"] / "hf")  # gathered from the expert shards by rank 0
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, run["state"][name]), name
    single = GLM46ForCausalLM(tiny_config())
    single.load_state_dict(single_muon["state"])
    hf = AutoModelForCausalLM.from_pretrained(run["out"] / "hf").eval()
    x = torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, single.eval()(x).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_equals_the_single_process_run(tmp_path, initial_weights, single_muon):
    """Heads, KV heads and MLP features split over 2 ranks that share one batch (tokens counted once)."""
    assert_same_run(run_layout(tmp_path, "tp", init_from=initial_weights, devices=2), single_muon)


@pytest.fixture(scope="module")
def single_packed(tmp_path_factory, initial_weights):
    return run_layout(tmp_path_factory.mktemp("single_packed"), "single", init_from=initial_weights, packed=True)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [1, 2])
def test_tensor_parallel_with_sequence_parallelism_equals_the_single_process_run(
    tmp_path, initial_weights, single_packed, expert_parallel
):
    """TP 2 with the residual stream split over the sequence between the TP regions, on rows of two documents with
    MTP: each rank runs the norms, router, experts, MTP projection and loss on its 8 of the 16 tokens; at EP 2 (4
    processes) the experts fold over TP and each rank sends its own tokens. Equal to one process."""
    overrides = ["parallelism.sequence_parallel=true", f"parallelism.expert_parallel={expert_parallel}"]
    devices = 2 * expert_parallel
    run = run_layout(tmp_path, "tp", init_from=initial_weights, devices=devices, packed=True, overrides=overrides)
    assert_same_run(run, single_packed)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "devices, overrides",
    [
        (2, []),  # CP 2 alone: the weights sharded over the two cp ranks
        (4, []),  # CP 2 x FSDP2 over 2 data-parallel ranks
        (4, ["parallelism.tensor_parallel=2", "parallelism.sequence_parallel=true"]),  # CP 2 x TP 2 + SP
        (4, ["parallelism.expert_parallel=2"]),  # CP 2 x EP 2
    ],
    ids=["cp2", "cp2-fsdp2", "cp2-tp2-sp", "cp2-ep2"],
)
def test_context_parallelism_equals_the_single_process_run(
    tmp_path, initial_weights, single_packed, devices, overrides
):
    """Each cp rank runs chunks 4 of 16 tokens apart (rank 0: 0-3 and 12-15, rank 1: 4-11) of rows of two
    documents that start anywhere from token 3 to 11, with MTP, whose targets cross the chunk edges: attention over
    the all-gathered keys, the loss and expert counts summed over the cp ranks, FSDP2 over the data-parallel and
    cp ranks. Equal to one process."""
    overrides = ["parallelism.context_parallel=2", *overrides]
    run = run_layout(tmp_path, "fsdp2", init_from=initial_weights, devices=devices, packed=True, overrides=overrides)
    assert_same_run(run, single_packed)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_x_expert_parallel_equals_the_single_process_run_and_its_checkpoint_resumes_at_ep2(
    tmp_path, initial_weights, single_muon
):
    """4 processes: FSDP2 over 4, experts over ep=2 and FSDP over the 2 ranks holding each half, selective activation
    checkpointing on; built on meta, each rank reads its slices of init_from and the export is assembled from
    the shards; a distributed checkpoint (DCP) after step 2 resumes on 2 processes at ep=2 (resharded)."""
    run = run_layout(
        tmp_path,
        "fsdp2_ep",
        init_from=initial_weights,
        devices=4,
        checkpoint_every=1,
        hf=True,
        overrides=["parallelism.activation_checkpointing=true", "parallelism.activation_checkpointing_mode=selective"],
    )
    assert run["expert_parallel"] == 2
    assert_same_run(run, single_muon)
    assert_loads_and_exports_like_one_process(run, initial_weights, tmp_path)
    checkpoint = run["out"] / "step2.ckpt"
    assert checkpoint.is_dir() and len(list(checkpoint.glob("*.distcp"))) == 4, "one shard file per rank"
    assert_weights_of_checkpoint(run["out"] / "step3.ckpt", run["state"])  # init_from reads it in one process

    resumed = run_layout(tmp_path / "resumed", "ep", init_from=initial_weights, devices=2, resume=str(checkpoint))
    assert_same_run(resumed, single_muon, first_step=2)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [2, 4])
def test_production_layout_tp2_x_ep_x_fsdp2_equals_the_single_process_run(
    tmp_path, initial_weights, single_muon, expert_parallel
):
    """conf/parallelism/production.yaml (TP x EP x FSDP2, activation checkpointing) at TP 2 on 4 ranks, without its
    pipeline stages (the pipeline tests below cover them). The ep groups fold over TP, so each rank holds a quarter
    of the experts, not the half it would with experts replicated on TP: at EP 2 half of them by EP over its TP
    pair and FSDP2 over the 2 data-parallel ranks (with the layout's sequence parallelism: each TP rank routes its
    own tokens), at EP 4 a quarter by EP over all 4 ranks (without: each TP rank routes half of the pair's common
    tokens)."""
    run = run_layout(
        tmp_path,
        "production",
        init_from=initial_weights,
        devices=4,
        hf=expert_parallel == 2,
        overrides=[
            "parallelism.tensor_parallel=2",
            f"parallelism.expert_parallel={expert_parallel}",
            "parallelism.pipeline_parallel=1",
            "parallelism.pipeline_schedule=1F1B",
            "parallelism.virtual_stages=1",
            "parallelism.microbatches=1",
            f"parallelism.sequence_parallel={expert_parallel == 2}",  # at EP 4 the TP ranks split their tokens
        ],
    )
    assert run["expert_parallel"] == expert_parallel and run["expert_share"] == 1 / 4
    assert_same_run(run, single_muon)
    if expert_parallel == 2:
        assert_loads_and_exports_like_one_process(run, initial_weights, tmp_path)  # TP x FSDP: _StridedShard slices


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_with_its_bf16_mixed_precision_policy_trains(tmp_path, initial_weights, single_muon):
    """The policy trainer.precision=bf16-mixed implies for the fsdp2 member (bf16 parameters, fp32 reductions;
    the Trainer here stays at 32-true, no autocast): close to the fp32 run, not equal. At 32-true, the composition
    of the other tests, the member has no policy and equals one process."""
    run = run_layout(
        tmp_path, "fsdp2", init_from=initial_weights, devices=2, overrides=["trainer.precision=bf16-mixed"]
    )
    for a, b in zip(run["losses"], single_muon["losses"]):
        assert abs(a - b) <= 1e-2 * b


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_mixed_precision_on_one_process_is_the_autocast_step_within_bf16(tmp_path, initial_weights):
    """trainer.precision=bf16-mixed under fsdp2 on one process: FSDP2 wraps the model anyway, for its policy (bf16
    weights in the step, fp32 masters, fp32 reductions), as on many ranks. Within bf16's error of one process under
    Lightning's autocast (fp32 weights cast at each use)."""
    autocast = run_layout(tmp_path / "autocast", "single", init_from=initial_weights, precision="bf16-mixed")
    run = run_layout(tmp_path, "fsdp2", init_from=initial_weights, overrides=["trainer.precision=bf16-mixed"])
    assert run["expert_share"] == 1.0  # DTensor weights: FSDP2 wrapped the model on its one rank
    for a, b in zip(run["losses"], autocast["losses"], strict=True):
        assert abs(a - b) <= 1e-2 * b


@pytest.mark.distributed
@pytest.mark.slow
def test_deepspeed_zero3_trains_checkpoints_resumes_and_exports(tmp_path, initial_weights, single_adamw):
    """ZeRO-3 on CPU (gloo) with AdamW: equal to the single-process run; its sharded checkpoint after step 2
    resumes, with parameters and optimizer state offloaded to CPU, to the same step 3; hf/ is gathered from
    the partitions."""
    from glm46.hf import load_hf

    run = run_layout(
        tmp_path, "deepspeed_zero3", init_from=initial_weights, devices=2, optimizer="adamw", checkpoint_every=1
    )
    assert_same_run(run, single_adamw)
    checkpoint = run["out"] / "step2.ckpt"
    assert len(list((checkpoint / "checkpoint").glob("zero_pp_rank_*_optim_states.pt"))) == 2, "partitioned state"
    assert_weights_of_checkpoint(run["out"] / "step3.ckpt", run["state"])

    offload = [
        "parallelism.offload_parameters=true",
        "parallelism.offload_optimizer=true",
        "parallelism.force_deepspeed_cpu_optimizer=false",
    ]  # the torch AdamW steps the offloaded state
    resumed = run_layout(
        tmp_path / "resumed",
        "deepspeed_zero3",
        init_from=initial_weights,
        devices=2,
        optimizer="adamw",
        hf=True,
        resume=str(checkpoint),
        overrides=offload,
    )
    assert_same_run(resumed, single_adamw, first_step=2)
    for name, tensor in load_hf(resumed["out"] / "hf").state_dict().items():
        assert torch.equal(tensor, resumed["state"][name]), name


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_pipeline_parallel_equals_the_single_process_run(tmp_path, initial_weights, single_muon, schedule):
    """Two stages on two processes (stage 0: embedding and the dense layer; stage 1: the MoE layers, MTP and the
    head), the batch in two microbatches: the same losses, expert counts and final weights as one process."""
    overrides = [f"parallelism.pipeline_schedule={schedule}"]
    run = run_layout(tmp_path, "pp", init_from=initial_weights, devices=2, overrides=overrides)
    assert_same_run(run, single_muon)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_pipeline_step_runs_its_accumulated_batches_as_one_schedule(tmp_path, initial_weights, single_muon):
    """Each step's 4 rows in 2 batches of 2 (gradient accumulation 2) on 2 stages: the first batch is held, the
    second runs both as the 4 microbatches of one schedule (one fill and drain per step). The same losses, expert
    counts and final weights as one process taking the step's 4 rows at once."""
    run = run_layout(tmp_path, "pp", init_from=initial_weights, devices=2, accumulate=2)
    assert run["schedules"] == [4]  # 2 microbatches per batch (parallelism=pp) x 2 batches, in one schedule
    assert_same_run(run, single_muon)


@pytest.mark.distributed
@pytest.mark.slow
def test_the_step_guard_skips_a_bad_step_on_every_stage_as_in_one_process(tmp_path, initial_weights):
    """A NaN gradient at step 1 on whichever rank holds the first gradient: the norm over the stages is NaN on both,
    both skip the step, and the run goes on equal to one process that skipped it too."""
    single = run_layout(tmp_path / "single", "single", init_from=initial_weights, nan_gradient_at=1)
    run = run_layout(tmp_path, "pp", init_from=initial_weights, devices=2, nan_gradient_at=1)
    assert single["skipped_steps"] == run["skipped_steps"] == 1
    assert_same_run(run, single)


DEEP = {"num_hidden_layers": 4}  # four stages of one layer each for the schedules with two stages per rank


@pytest.fixture(scope="module")
def deep_weights(tmp_path_factory) -> str:
    from glm46.hf import save_hf
    from tests.helpers import random_model, tiny_config

    return str(save_hf(random_model(tiny_config(**DEEP), seed=0), tmp_path_factory.mktemp("deep") / "hf"))


@pytest.fixture(scope="module")
def single_deep(tmp_path_factory, deep_weights):
    return run_layout(tmp_path_factory.mktemp("single_deep"), "single", init_from=deep_weights, model=DEEP)


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_x_tensor_parallel_with_sequence_parallelism_equals_the_single_process_run(tmp_path, deep_weights):
    """2 stages x TP 2 with sequence parallelism (4 processes) on rows of two documents: the stages send each TP
    rank's half of the sequence (and of the MTP embeddings), the loss terms are summed over stages and TP ranks."""
    single = run_layout(tmp_path / "single", "single", init_from=deep_weights, model=DEEP, packed=True)
    overrides = ["parallelism.tensor_parallel=2", "parallelism.sequence_parallel=true"]
    run = run_layout(tmp_path, "pp", init_from=deep_weights, devices=4, model=DEEP, packed=True, overrides=overrides)
    assert_same_run(run, single)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("schedule, microbatches", [("Interleaved1F1B", 2), ("ZBVZeroBubble", 4), ("DualPipeV", 4)])
def test_schedules_with_two_stages_per_rank_equal_the_single_process_run(
    tmp_path, deep_weights, single_deep, schedule, microbatches
):
    """Four one-layer stages on two processes, two per rank: looped (Interleaved1F1B: rank 0 runs stages 0 and 2)
    or V-shaped (ZBVZeroBubble and DualPipeV: rank 0 runs stages 0 and 3, so the embedding and the head share a
    rank), with the zero-bubble schedules' split of the backward into input and weight gradients."""
    overrides = [
        f"parallelism.pipeline_schedule={schedule}",
        "parallelism.virtual_stages=2",
        f"parallelism.microbatches={microbatches}",
    ]
    run = run_layout(tmp_path, "pp", init_from=deep_weights, devices=2, overrides=overrides, model=DEEP)
    assert_same_run(run, single_deep)


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_x_fsdp2_x_expert_parallel_equals_one_process_and_resumes_without_stages(
    tmp_path, initial_weights, single_muon
):
    """4 processes: 2 stages, each FSDP2 over its 2 ranks with the experts split over them (ep 2). Equal to one
    process; the Hub export is assembled stage by stage; its distributed checkpoint after step 2 resumes under
    fsdp2 on 2 processes (no stages) to the same step 3, and the fsdp2 run's checkpoint resumes with stages."""
    run = run_layout(
        tmp_path,
        "pp",
        init_from=initial_weights,
        devices=4,
        checkpoint_every=1,
        hf=True,
        overrides=["parallelism.expert_parallel=2"],
    )
    assert run["expert_parallel"] == 2
    assert_same_run(run, single_muon)
    assert_loads_and_exports_like_one_process(run, initial_weights, tmp_path)
    assert_weights_of_checkpoint(run["out"] / "step3.ckpt", run["state"])

    without_stages = run_layout(
        tmp_path / "fsdp2", "fsdp2", init_from=initial_weights, devices=2, resume=str(run["out"] / "step2.ckpt")
    )
    assert_same_run(without_stages, single_muon, first_step=2)
    fsdp2 = run_layout(tmp_path / "from", "fsdp2", init_from=initial_weights, devices=2, checkpoint_every=1)
    with_stages = run_layout(
        tmp_path / "to", "pp", init_from=initial_weights, devices=2, resume=str(fsdp2["out"] / "step2.ckpt")
    )
    assert_same_run(with_stages, single_muon, first_step=2)
