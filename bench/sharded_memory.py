"""Peak resident memory per rank of a sharded run against the plan and against one replica, on this CPU.

    python bench/sharded_memory.py                      # fsdp2 and fsdp2_ep, 4 gloo processes
    python bench/sharded_memory.py --layouts fsdp2 --steps 3

A GLM-4.6-shaped model of about 0.8B parameters whose replicated training state (fp32 weights, fp32
gradients, two fp32 AdamW moments: 16 bytes a parameter, about 12 GiB) would not fit this 24 GiB
machine four times over, trained by 4 gloo processes through the real path: GLM46LitModule built on
the meta device, glm46.lit.strategies.MeshParallelStrategy (FSDP2, expert parallel), a few optimizer steps,
then the HF export assembled from the shards. AdamW rather than Muon: Newton-Schulz on every matrix
would take hours on 2 cores, and its state is smaller (one moment), so AdamW is the heavier case.

Each rank records its peak RSS after materialisation, after training and after the export; the
table sets the largest rank beside the plan's per-device figure for the same layout (weights,
gradients, optimizer, FSDP2's gathered units; activations at this batch are small) and the
replicated footprint, and prints the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIELDS = dict(
    vocab_size=32768,
    hidden_size=1536,
    intermediate_size=4096,
    moe_intermediate_size=512,
    num_hidden_layers=9,
    first_k_dense_replace=1,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=128,
    n_routed_experts=32,
    num_experts_per_tok=4,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=4096,
)
LAYOUTS = {"fsdp2": {"expert_parallel": 1}, "fsdp2_ep": {"expert_parallel": 2}}
WORLD, SEQ = 4, 128
GIB = 2**30


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(layout: str, steps: int, out: Path) -> None:
    """One launch: Lightning starts the other ranks; every rank writes its peaks to out/rank<r>.json."""
    import functools

    import lightning as L
    from torch.utils.data import DataLoader

    from glm46.hf import save_hf
    from glm46.lit import GLM46LitModule
    from glm46.lit.strategies import MeshParallelStrategy
    from glm46.modules import GLM46Config
    from glm46.optim import Piecewise
    from glm46.parallel import Layout

    config = GLM46Config(**FIELDS)
    peaks = {"start": peak_rss()}

    class Peaks(L.Callback):
        def on_train_start(self, trainer, pl_module):
            peaks["materialised"] = peak_rss()

        def on_train_end(self, trainer, pl_module):
            peaks["trained"] = peak_rss()

    module = GLM46LitModule(
        config,
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
        lr_schedule=lambda tokens: 1.0,  # a factor of the optimizer's LR
        mtp_weight=Piecewise(values=[0.3], boundaries=[]),
        empty_init=True,
    )
    tokens = torch.randint(0, config.vocab_size, (WORLD * steps, SEQ + 1), generator=torch.Generator().manual_seed(0))
    batches = [
        {
            "input_ids": t[:-1],
            "labels": t[1:],
            "position_ids": torch.arange(SEQ),
            "loss_mask": torch.ones(SEQ, dtype=torch.long),
        }
        for t in tokens
    ]
    strategy = MeshParallelStrategy(
        Layout(WORLD, expert_parallel=LAYOUTS[layout]["expert_parallel"], data_parallel_shard=WORLD),
        mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"},
        activation_checkpointing="full",
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Peaks()],
        gradient_clip_val=1.0,
    )
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=1))
    save_hf(module.model, out / "hf")
    peaks["exported"] = peak_rss()
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(peaks))


def planned_bytes(layout: str) -> tuple[float, float]:
    """(the plan's per-device bytes for weights + gradients + optimizer + FSDP2 units, one replica's state)."""
    from glm46.modules import GLM46Config
    from glm46.parallel.layout import Layout
    from glm46.planning.plan import fsdp_units, gathered_bytes, planned_parameters, state_by_group

    config = GLM46Config(**FIELDS)
    layout_ = Layout(WORLD, 1, LAYOUTS[layout]["expert_parallel"], WORLD)
    state = sum(sum(g.values()) for g in state_by_group(planned_parameters(config, layout_, "adamw")).values())
    gathered = sum(gathered_bytes(fsdp_units(config, layout_)).values())
    replica = sum(sum(g.values()) for g in state_by_group(planned_parameters(config, Layout(1), "adamw")).values())
    return state + gathered, replica


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=sorted(LAYOUTS), choices=sorted(LAYOUTS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: layout of one launch
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, Path(args.out))

    from glm46.modules import GLM46Config
    from glm46.planning.counts import count_parameters

    print(
        f"model: {count_parameters(GLM46Config(**FIELDS))['total'] / 1e9:.2f}B parameters, {WORLD} gloo processes, "
        f"{args.steps} AdamW steps of 1 x {SEQ} tokens per rank, then the HF export"
    )
    print(
        f"{'layout':10s} {'peak RSS per rank after materialise / train / export (GiB)':62s} {'plan':>6s} "
        f"{'replica':>8s} {'replica / peak':>15s}"
    )
    for layout in args.layouts:
        with tempfile.TemporaryDirectory() as out:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--worker",
                    layout,
                    "--steps",
                    str(args.steps),
                    "--out",
                    out,
                ],
                check=True,
                env=env,
                cwd=out,
            )
            ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(WORLD)]
        plan, replica = planned_bytes(layout)
        cells = " ".join("/".join(f"{r[k] / GIB:.1f}" for k in ("materialised", "trained", "exported")) for r in ranks)
        worst = max(r["exported"] for r in ranks)
        print(f"{layout:10s} {cells:62s} {plan / GIB:6.2f} {replica / GIB:8.2f} {replica / worst:15.2f}")


if __name__ == "__main__":
    main()
