"""Muon and the HF export on sharded weights, in 2 and 4 gloo processes without Lightning (tests.ranks): the same
gradients give the same weights as single-process Muon (FSDP2 shards, TP column/row shards, EP expert shards, and
their products), with the Newton-Schulz work divided among the ranks, not repeated; save_hf of a sharded model writes
the single-process export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from glm46.optim import Muon, muon_param_groups

from .helpers import random_model, tiny_config
from .ranks import run_ranks

LAYOUTS = {  # world size -> name -> (tensor_parallel, expert_parallel, data_parallel_shard, model overrides)
    2: {
        "fsdp2": (1, 1, 2, {}),
        "tp": (2, 1, 1, {}),
        "ep": (1, 2, 1, {}),
        "fsdp2_ep": (1, 2, 2, {}),
    },
    4: {
        "fsdp2": (1, 1, 4, {}),
        "tp": (4, 1, 1, {"num_key_value_heads": 4}),
        "ep": (1, 4, 1, {}),
        # 3 experts per ep rank over 2 FSDP2 ranks: the expert stacks are split on rows (owner-orthogonalised)
        "fsdp2_ep": (1, 2, 4, {"n_routed_experts": 6}),
        "tp_ep_fsdp2": (2, 2, 2, {}),  # FSDP2 over TP: matrices cut on two mesh dims
    },
}
DIVIDED = {"fsdp2"}  # every Muon matrix split over all ranks: each is orthogonalised exactly once, somewhere


def _muon(model):
    return Muon(muon_param_groups(model), lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)


def _worker(out: str) -> None:
    """One rank (tests.ranks): every layout of its world size, in turn."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from bench.muon_sharded import counting  # the bench's FLOP counter
    from glm46.hf import save_hf
    from glm46.optim import distributed_muon
    from glm46.parallel.layout import Layout
    from glm46.parallel.mesh import build_mesh
    from glm46.parallel.parallelize import parallelize

    dist.init_process_group("gloo")  # rank, world size and address from the environment the launcher set
    rank, world = dist.get_rank(), dist.get_world_size()
    flops = counting(distributed_muon)
    try:
        for name, (tp, ep, shard, overrides) in LAYOUTS[world].items():
            reference = random_model(tiny_config(**overrides), seed=0).train()
            model = random_model(tiny_config(**overrides), seed=0).train()
            layout = Layout(world, tp, ep, shard)
            parallelize(model, layout, build_mesh(layout, "cpu"))
            sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
            assert sharded, f"{name}: nothing was sharded"
            ours, theirs = _muon(model), _muon(reference)
            generator = torch.Generator().manual_seed(7)
            single_flops = 0
            for _ in range(3):  # the same full gradients on every rank; each keeps its slice
                for (_, p), q in zip(model.named_parameters(), reference.parameters()):
                    grad = torch.randn(q.shape, generator=generator)
                    q.grad = grad
                    p.grad = (
                        distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
                        if isinstance(p, DTensor)
                        else grad.clone()
                    )
                flops[0] = 0
                ours.step()
                ours_flops = torch.tensor([flops[0]])
                theirs.step()
                single_flops = flops[0] - ours_flops.item()
            per_rank = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
            dist.all_gather(per_rank, ours_flops)
            per_rank = [int(f) for f in per_rank]
            assert max(per_rank) < single_flops, f"{name}: a rank did all the work: {per_rank} of {single_flops}"
            if name in DIVIDED:
                assert sum(per_rank) == single_flops, f"{name}: work repeated or lost: {per_rank} of {single_flops}"
                assert max(per_rank) <= 0.6 * single_flops, f"{name}: unbalanced: {per_rank} of {single_flops}"
            for (n, p), q in zip(model.named_parameters(), reference.parameters()):
                full = p.full_tensor() if isinstance(p, DTensor) else p
                error = ((full - q).norm() / q.norm()).item()
                assert error < 1e-6, f"{name}: {n} differs from single-process Muon by {error:.1e}"
            if name == "fsdp2" and world == 2:
                save_hf(model, Path(out) / "sharded")  # every rank gathers; rank 0 writes
                if rank == 0:
                    save_hf(reference, Path(out) / "single")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.slow
def test_muon_on_four_ranks_divides_the_work_and_equals_single_process_muon(tmp_path):
    run_ranks(_worker, str(tmp_path), world_size=4, logs=tmp_path / "logs")


@pytest.mark.distributed
@pytest.mark.slow
def test_muon_on_fsdp2_tp_and_ep_shards_equals_single_process_muon_and_sharded_export(tmp_path):
    run_ranks(_worker, str(tmp_path), world_size=2, logs=tmp_path / "logs")
    from safetensors.torch import load_file

    sharded, single = (load_file(tmp_path / d / "model.safetensors") for d in ("sharded", "single"))
    assert sharded.keys() == single.keys()
    for key in single:
        torch.testing.assert_close(sharded[key], single[key], rtol=1e-6, atol=1e-7, msg=key)
    assert (tmp_path / "sharded" / "config.json").read_text() == (tmp_path / "single" / "config.json").read_text()
