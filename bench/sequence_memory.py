"""Activation memory of one long row split over 2 gloo processes, against the same 2 processes holding it whole
(the peer): the peak resident memory each rank adds during one forward and backward.

    python bench/sequence_memory.py                     # sequence parallelism: TP 2 + SP against TP 2, one 8K row
    python bench/sequence_memory.py --split context --seq-len 32768   # CP 2 against FSDP2 over 2 ranks, 32K row

Each layout runs in fresh processes (the peak of a process only grows); the model is bench/muon_sharded.py's, 4
layers. Sequence parallelism splits the norms', router's, experts' and loss's activations over the TP ranks; the TP
regions keep their all-gathered input. Context parallelism splits everything but attention's all-gathered keys and
values (the peer and CP 2 both shard the weights over the 2 ranks with FSDP2).
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.timing import spawn_on_gloo  # noqa: E402

WORLD = 2


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --split -> (the peer's layout, the split layout): Layout keyword arguments on WORLD ranks
SPLITS = {
    "sequence": (
        ("TP 2 (the peer)", {"tensor_parallel": WORLD}),
        ("TP 2 + sequence parallel", {"tensor_parallel": WORLD, "sequence_parallel": True}),
    ),
    "context": (
        ("FSDP2 on 2 (the peer)", {"data_parallel_shard": WORLD}),
        ("CP 2 (FSDP2 over cp)", {"context_parallel": WORLD}),
    ),
}


def worker(rank: int, port: int, sizes: dict, hidden: int, seq_len: int, results) -> None:
    from bench.muon_sharded import model_config
    from glm46.modules import GLM46ForCausalLM
    from glm46.parallel.layout import Layout
    from glm46.parallel.mesh import build_mesh
    from glm46.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        config = model_config(hidden)
        layout = Layout(WORLD, **sizes)
        torch.manual_seed(0)
        model = parallelize(GLM46ForCausalLM(config), layout, build_mesh(layout, "cpu"))
        tokens = torch.randint(0, config.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
        dist.barrier()
        before = peak_mib()
        model(tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
        dist.barrier()
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, peak_mib() - before)
        if rank == 0:
            results["added"] = gathered
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=sorted(SPLITS), default="sequence")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=8192)
    args = parser.parse_args()
    layouts = SPLITS[args.split]
    added = {
        name: spawn_on_gloo(worker, sizes, args.hidden, args.seq_len, processes=WORLD)["added"]
        for name, sizes in layouts
    }
    peer = max(added[layouts[0][0]])
    print(f"one row of {args.seq_len} tokens, hidden {args.hidden}, fp32; MiB added per rank in forward + backward:")
    for name, ranks in added.items():
        print(f"  {name:<26} {' '.join(f'{r:8.0f}' for r in ranks)}   x{max(ranks) / peer:.2f} the peer")


if __name__ == "__main__":
    main()
