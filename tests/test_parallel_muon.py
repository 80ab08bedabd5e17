"""Muon and the HF export on sharded weights, in 2 gloo processes without Lightning: the same gradients
give the same weights as single-process Muon (FSDP2 shards, TP column/row shards, EP expert shards),
and save_hf of a sharded model writes the single-process export."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glm46.optim import Muon, muon_param_groups

from .helpers import random_model, tiny_config

LAYOUTS = {  # name -> (tensor_parallel, expert_parallel, data_parallel_shard) on 2 ranks
    "fsdp2": (1, 1, 2),
    "tp": (2, 1, 1),
    "ep": (1, 2, 1),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _muon(model):
    return Muon(muon_param_groups(model), lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    from glm46.hf import save_hf
    from glm46.parallel.layout import Layout
    from glm46.parallel.mesh import build_mesh
    from glm46.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for name, (tp, ep, shard) in LAYOUTS.items():
            reference = random_model(tiny_config(), seed=0).train()
            model = random_model(tiny_config(), seed=0).train()
            layout = Layout(world, tp, ep, shard)
            parallelize(model, layout, build_mesh(layout, "cpu"))
            sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
            assert sharded, f"{name}: nothing was sharded"
            ours, theirs = _muon(model), _muon(reference)
            generator = torch.Generator().manual_seed(7)
            for _ in range(3):  # the same full gradients on every rank; each keeps its slice
                for (_, p), q in zip(model.named_parameters(), reference.parameters()):
                    grad = torch.randn(q.shape, generator=generator)
                    q.grad = grad
                    p.grad = (
                        distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
                        if isinstance(p, DTensor)
                        else grad.clone()
                    )
                ours.step()
                theirs.step()
            for (n, p), q in zip(model.named_parameters(), reference.parameters()):
                full = p.full_tensor() if isinstance(p, DTensor) else p
                error = ((full - q).norm() / q.norm()).item()
                assert error < 1e-6, f"{name}: {n} differs from single-process Muon by {error:.1e}"
            if name == "fsdp2":
                save_hf(model, Path(out) / "sharded")  # every rank gathers; rank 0 writes
                if rank == 0:
                    save_hf(reference, Path(out) / "single")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.slow
def test_muon_on_fsdp2_tp_and_ep_shards_equals_single_process_muon_and_sharded_export(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    from safetensors.torch import load_file

    sharded, single = (load_file(tmp_path / d / "model.safetensors") for d in ("sharded", "single"))
    assert sharded.keys() == single.keys()
    for key in single:
        torch.testing.assert_close(sharded[key], single[key], rtol=1e-6, atol=1e-7, msg=key)
    assert (tmp_path / "sharded" / "config.json").read_text() == (tmp_path / "single" / "config.json").read_text()
