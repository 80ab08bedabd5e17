"""Pipeline parallelism on 4 gloo processes: each rank's measured idle share of a training step against its
schedule's formula, and tokens/s against the same model and global batch under fsdp2 (the peer).

    python bench/pipeline.py                              # 1F1B at 4 and 8 microbatches, Interleaved1F1B, fsdp2
    python bench/pipeline.py --schedules 1F1B:4 GPipe:4 --hidden 512 --steps 5

One GLM-4.6-shaped model (bench/muon_sharded.py's, with 8 decoder layers) is split into stages by
glm46.parallel.pipeline_parallel on the 4 ranks (pp 4) and run by torch.distributed.pipelining's schedule, as a
training step does. A rank is busy while one of its stages runs a microbatch's forward or backward (torch's
PipelineStage.forward_one_chunk, backward_one_chunk, backward_weight_one_chunk, timed); the rest of the step it
waits for activations or gradients. The formula: the bubble (pp - 1) / (m + pp - 1) of 1F1B and GPipe, and
(pp - 1) / (v m + pp - 1) of the interleaved schedules (glm46.planning.plan.bubble). Every rank runs one thread;
4 processes share this machine's cores, so a rank that waits frees a core for the others: read the idle shares
on a machine with a core (or a GPU) per rank, where the formula assumes them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.timing import spawn_on_gloo  # noqa: E402

WORLD = 4


def model_config(hidden: int):
    """bench/muon_sharded.py's GLM-4.6-shaped model with 8 decoder layers: 2 per pipeline rank."""
    from bench.muon_sharded import model_config as muon_bench_config

    return dataclasses.replace(muon_bench_config(hidden), num_hidden_layers=8)


def batch(config, sequences: int, seq_len: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, config.vocab_size, (sequences, seq_len + 1), generator=torch.Generator().manual_seed(0))
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


class BusyClock:
    """Seconds this rank spends inside its stages' forward and backward calls (torch's PipelineStage methods)."""

    METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self):
        from torch.distributed.pipelining.stage import _PipelineStageBase

        self.seconds = 0.0
        for name in self.METHODS:
            original = getattr(_PipelineStageBase, name)
            setattr(_PipelineStageBase, name, self._timed(original))

    def _timed(self, method):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper


def pipelined_step_seconds(config, schedule: str, microbatches: int, data, steps: int, clock: BusyClock):
    """(wall seconds per step, busy seconds per step) of this rank, after one step that warms up."""
    from glm46.modules import GLM46ForCausalLM
    from glm46.parallel.layout import PIPELINE_SCHEDULES, Layout
    from glm46.parallel.mesh import build_mesh
    from glm46.parallel.parallelize import parallelize
    from glm46.parallel.pipeline_parallel import Pipeline, split_model, step_totals

    virtual = PIPELINE_SCHEDULES[schedule] or 2
    layout = Layout(
        WORLD, pipeline_parallel=WORLD, pipeline_schedule=schedule, virtual_stages=virtual, microbatches=microbatches
    )
    mesh = build_mesh(layout, "cpu")
    torch.manual_seed(0)
    model = GLM46ForCausalLM(config)
    rank = dist.get_rank()
    stages = split_model(model, layout, rank)
    parallelize(model, layout, mesh, stages=stages)
    pipeline = Pipeline(stages, layout, mesh, torch.device("cpu"))
    totals = step_totals(data, config, mtp_weight=0.3, alpha=1e-4, accumulation=1)
    pipeline.step(data, totals)
    dist.barrier()
    clock.seconds = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        pipeline.step(data, totals)
        model.zero_grad(set_to_none=True)
    dist.barrier()
    return (time.perf_counter() - start) / steps, clock.seconds / steps


def fsdp2_step_seconds(config, data, steps: int) -> float:
    """Wall seconds per step of fsdp2 on the 4 ranks, each taking a quarter of the global batch."""
    from glm46.modules import GLM46ForCausalLM
    from glm46.parallel.layout import Layout
    from glm46.parallel.mesh import build_mesh
    from glm46.parallel.parallelize import parallelize

    layout = Layout(WORLD, data_parallel_shard=WORLD)
    torch.manual_seed(0)
    model = parallelize(GLM46ForCausalLM(config), layout, build_mesh(layout, "cpu"))
    share = data["input_ids"].shape[0] // WORLD
    mine = {k: v[dist.get_rank() * share : (dist.get_rank() + 1) * share] for k, v in data.items()}

    def step():
        model(mine["input_ids"], labels=mine["labels"]).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def worker(rank: int, port: int, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        config = model_config(args.hidden)
        data = batch(config, args.sequences, args.seq_len)
        clock = BusyClock()
        rows = {}
        for item in args.schedules:
            schedule, microbatches = item.split(":")
            wall, busy = pipelined_step_seconds(config, schedule, int(microbatches), data, args.steps, clock)
            rows[item] = (wall, busy)
        rows["fsdp2"] = (fsdp2_step_seconds(config, data, args.steps), None)
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            results.update({"ranks": gathered})
    finally:
        dist.destroy_process_group()


def main() -> None:
    from glm46.parallel.layout import PIPELINE_SCHEDULES, Layout
    from glm46.planning.plan import bubble

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["1F1B:4", "1F1B:8", "Interleaved1F1B:8"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--sequences", type=int, default=8, help="the global batch, split into the microbatches")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    results = spawn_on_gloo(worker, args, processes=WORLD)

    ranks = results["ranks"]
    tokens = args.sequences * args.seq_len
    fsdp2 = max(r["fsdp2"][0] for r in ranks)
    print(f"{WORLD} gloo processes, hidden {args.hidden}, {args.sequences} x {args.seq_len} tokens per step, fp32")
    print(f"{'layout':<22} {'idle per pp rank (measured)':<30} {'formula':>8} {'tokens/s':>9} {'x fsdp2':>8}")
    for item in args.schedules:
        schedule, microbatches = item.split(":")
        virtual = PIPELINE_SCHEDULES[schedule] or 2
        layout = Layout(WORLD, pipeline_parallel=WORLD, virtual_stages=virtual, microbatches=int(microbatches))
        wall = max(r[item][0] for r in ranks)
        idle = " ".join(f"{1 - r[item][1] / r[item][0]:.2f}" for r in ranks)
        print(f"pp {WORLD} {item:<17} {idle:<30} {bubble(layout):>8.2f} {tokens / wall:>9.0f} {fsdp2 / wall:>8.2f}")
    print(f"{'fsdp2 (the peer)':<22} {'':<30} {'':>8} {tokens / fsdp2:>9.0f} {1:>8.2f}")


if __name__ == "__main__":
    main()
