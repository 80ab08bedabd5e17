"""Activation memory of one long row under TP 2 with sequence parallelism, against TP 2 without it (the peer), on 2
gloo processes: the peak resident memory each rank adds during one forward and backward.

    python bench/sequence_memory.py                     # one 8K row, bench/muon_sharded.py's model, 4 layers
    python bench/sequence_memory.py --seq-len 16384

Each layout runs in fresh processes (the peak of a process only grows). Sequence parallelism splits the norms',
router's, experts' and loss's activations over the TP ranks; the TP regions keep their all-gathered input.
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


def worker(rank: int, port: int, sequence_parallel: bool, hidden: int, seq_len: int, results) -> None:
    from bench.muon_sharded import model_config
    from glm46.modules import GLM46ForCausalLM
    from glm46.parallel.layout import Layout
    from glm46.parallel.mesh import build_mesh
    from glm46.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        config = model_config(hidden)
        layout = Layout(WORLD, tensor_parallel=WORLD, sequence_parallel=sequence_parallel)
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
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=8192)
    args = parser.parse_args()
    added = {
        name: spawn_on_gloo(worker, sp, args.hidden, args.seq_len, processes=WORLD)["added"]
        for name, sp in (("TP 2 (the peer)", False), ("TP 2 + sequence parallel", True))
    }
    peer = max(added["TP 2 (the peer)"])
    print(f"one row of {args.seq_len} tokens, hidden {args.hidden}, fp32; MiB added per rank in forward + backward:")
    for name, ranks in added.items():
        print(f"  {name:<26} {' '.join(f'{r:8.0f}' for r in ranks)}   x{max(ranks) / peer:.2f} the peer")


if __name__ == "__main__":
    main()
