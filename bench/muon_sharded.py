"""Newton-Schulz work per rank of Muon on sharded updates: owner-per-matrix (glm46) against single-process Muon
and against gathering every matrix on every rank, on 4 gloo processes.

    python bench/muon_sharded.py                     # fsdp2 and fsdp2_ep, 4 processes
    python bench/muon_sharded.py --layouts fsdp2 --hidden 512

A GLM-4.6-shaped model (attention, dense and shared MLPs, routed expert stacks, the MTP layer) is
sharded by glm46.parallel.parallelize; random gradients stand for the momentum updates. Three ways
to orthogonalise them, timed on every rank (each rank one thread):

- single: one process orthogonalises every matrix of the whole model (what every rank of a
  replicated run does, and the work to divide);
- gather-all: every rank all-gathers each split matrix and orthogonalises all of them (glm46 before
  distributed Muon; same-shape matrices batched, as in ours, so only the division differs);
- owner: glm46.optim.distributed_muon (each split matrix on one owner, experts local).

Prints Newton-Schulz GFLOP and wall seconds of the slowest rank and the ratios. The 4 processes share
this machine's cores, so wall time is best read on a machine with a core per rank; FLOPs are exact.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.timing import spawn_on_gloo, timed  # noqa: E402

WORLD = 4
LAYOUTS = {"fsdp2": (1, 1, 4), "fsdp2_ep": (1, 2, 4), "tp_ep_fsdp2": (2, 2, 2)}  # (tp, ep, data_parallel_shard)


def model_config(hidden: int):
    from glm46.modules import GLM46Config

    return GLM46Config(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=hidden // 64,
        num_key_value_heads=4,
        head_dim=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        num_nextn_predict_layers=1,
    )


def counting(module):
    """Wrap module.orthogonalize_batched; the returned list holds this rank's Newton-Schulz FLOPs."""
    counted = [0]
    original = module.orthogonalize_batched

    def wrapper(updates, specs, *args):
        counted[0] += sum(spec.flops(tuple(u.shape)) for u, spec in zip(updates, specs))
        return original(updates, specs, *args)

    module.orthogonalize_batched = wrapper
    return counted


def shard_like(p, full):
    """`full` split as the parameter p is (each rank keeps its slice), or itself when p is not sharded."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else full


def gather_all(updates, specs):
    """Every split matrix all-gathered whole on every rank, all orthogonalised everywhere."""
    from torch.distributed.tensor import Replicate

    from glm46.optim import distributed_muon as dm

    wholes = []
    for u in updates:
        if dm.matrix_dims(u):
            placements = [Replicate() if dm.splits_matrices(p, u.ndim) else p for p in u.placements]
            wholes.append(u.redistribute(u.device_mesh, placements).to_local())
        else:
            wholes.append(dm.local_tensor(u))
    return dm.orthogonalize_batched(wholes, specs)


def worker(rank: int, port: int, layouts: list[str], hidden: int, results) -> None:
    from glm46.modules import GLM46ForCausalLM
    from glm46.optim import distributed_muon as dm
    from glm46.optim import muon_param_groups
    from glm46.optim.newton_schulz import NewtonSchulz
    from glm46.parallel.layout import Layout
    from glm46.parallel.mesh import build_mesh
    from glm46.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    flops = counting(dm)
    try:
        for name in layouts:
            torch.manual_seed(0)
            model = GLM46ForCausalLM(model_config(hidden))
            groups = [g for g in muon_param_groups(model) if g["use_muon"]]
            names = {id(p): n for n, p in model.named_parameters()}
            muon = [names[id(p)] for g in groups for p in g["params"]]
            specs = [NewtonSchulz(g.get("row_chunks", 1), 5, torch.float32) for g in groups for _ in g["params"]]
            shapes = dict((n, p.shape) for n, p in model.named_parameters())
            full = [torch.randn(shapes[n], generator=torch.Generator().manual_seed(i)) for i, n in enumerate(muon)]
            row = {}
            if name == layouts[0]:
                dist.barrier()
                if rank == 0:  # alone, so it gets a core to itself
                    flops[0] = 0
                    _, wall, _ = timed(lambda full=full, specs=specs: dm.orthogonalize_batched(full, specs))
                    row["single"] = (flops[0], wall)
                dist.barrier()
            layout = Layout(WORLD, *LAYOUTS[name])
            parallelize(model, layout, build_mesh(layout, "cpu"))  # new (DTensor) parameters: look them up again
            sharded = dict(model.named_parameters())
            updates = [shard_like(sharded[n], g) for n, g in zip(muon, full)]
            for approach, run in (("gather-all", gather_all), ("owner", dm.orthogonalize_updates)):
                dist.barrier()
                flops[0] = 0
                _, wall, _ = timed(lambda run=run, u=updates, s=specs: run(u, s))
                row[approach] = (flops[0], wall)
            gathered = [None] * WORLD
            dist.all_gather_object(gathered, row)
            if rank == 0:
                results[name] = gathered
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["fsdp2", "fsdp2_ep"], choices=list(LAYOUTS))
    parser.add_argument("--hidden", type=int, default=768)
    args = parser.parse_args()
    results = spawn_on_gloo(worker, args.layouts, args.hidden, processes=WORLD)

    single_flops, single_wall = results[args.layouts[0]][0]["single"]
    print(f"Newton-Schulz on {WORLD} gloo processes, hidden {args.hidden}, fp32, 5 steps; slowest rank:")
    print(f"{'layout':<12} {'approach':<11} {'GFLOP/rank':>10} {'wall s':>8} {'x single':>9} {'x gather-all':>13}")
    print(f"{'(none)':<12} {'single':<11} {single_flops / 1e9:>10.2f} {single_wall:>8.2f} {1:>9.2f} {'':>13}")
    for name in args.layouts:
        ranks = results[name]
        gather = max(r["gather-all"][0] for r in ranks), max(r["gather-all"][1] for r in ranks)
        for approach in ("gather-all", "owner"):
            work = max(r[approach][0] for r in ranks)
            wall = max(r[approach][1] for r in ranks)
            print(
                f"{name:<12} {approach:<11} {work / 1e9:>10.2f} {wall:>8.2f} {single_wall / wall:>9.2f} "
                f"{gather[1] / wall:>13.2f}   (FLOPs per rank: {[round(r[approach][0] / 1e9, 2) for r in ranks]})"
            )


if __name__ == "__main__":
    main()
