"""Memory of the sharded start: a model built on meta allocates nothing, and after materialisation each rank's
resident memory grows by its own shards plus a fixed overhead, never by the whole model.

Each measurement is its own set of processes (peak RSS is per process): this file as a script,
`python -m tests.test_sharded_memory '<json>'`, run once per rank with gloo. The overhead is measured, not
assumed: the same layout materialising a tiny model."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
# About 100M parameters (400 MiB in fp32): a whole copy on a rank is 2-4x the shards of these layouts.
LARGE = dict(vocab_size=16384, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, first_k_dense_replace=1, n_routed_experts=16,
             num_experts_per_tok=2, max_position_embeddings=256)
SMALL = dict(LARGE, vocab_size=256, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4)
LAYOUTS = {"fsdp2": (-1, 1, 1), "ep": (1, 1, 4), "fsdp2_ep": (-1, 1, 2), "tp": (-1, 2, 1)}  # shard, tp, ep


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(spec: dict) -> None:
    """One rank: build on meta, lay out, materialise; report the growth of the peak RSS and the shard bytes."""
    import torch
    import torch.distributed as dist

    from glm46.modules import GLM46Config, GLM46ForCausalLM
    from glm46.parallel.layout import Layout
    from glm46.parallel.materialize import materialize
    from glm46.parallel.mesh import build_mesh
    from glm46.parallel.parallelize import parallelize

    dist.init_process_group("gloo")
    shard, tp, ep = LAYOUTS[spec["layout"]]
    world = dist.get_world_size()
    layout = Layout(world, tp, ep, world // tp if shard == -1 else shard)
    mesh = build_mesh(layout, "cpu")
    torch.manual_seed(0)
    before = peak_rss()
    with torch.device("meta"):
        model = GLM46ForCausalLM(GLM46Config(**spec["model"]))
    parallelize(model, layout, mesh)
    materialize(model, "cpu")
    grown = peak_rss() - before
    tensors = [*model.parameters(), *model.buffers()]
    local = sum((t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes() for t in tensors)
    whole = sum(t.numel() * t.element_size() for t in tensors)
    Path(spec["out"], f"rank{dist.get_rank()}.json").write_text(json.dumps({"grown": grown, "local": local,
                                                                             "whole": whole}))
    dist.destroy_process_group()


def measure(tmp_path: Path, layout: str, model: dict) -> list[dict]:
    out = tmp_path / f"{layout}-{model['hidden_size']}"
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = json.dumps({"layout": layout, "model": model, "out": str(out)})
    processes = [subprocess.Popen([sys.executable, "-m", "tests.test_sharded_memory", spec], cwd=ROOT,
                                  env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                       "RANK": str(r), "WORLD_SIZE": "4", "OMP_NUM_THREADS": "1"},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(4)]
    for p in processes:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_rank_holds_its_shards_plus_a_fixed_overhead(tmp_path, layout):
    overhead = max(r["grown"] - r["local"] for r in measure(tmp_path, layout, SMALL)) + 16 * MIB  # allocator slack
    for rank, r in enumerate(measure(tmp_path, layout, LARGE)):
        assert r["local"] < r["whole"] / 1.9, f"rank {rank}: the layout should shard most of the model"
        assert r["grown"] <= r["local"] + overhead, (
            f"rank {rank} grew {r['grown'] / MIB:.0f} MiB for {r['local'] / MIB:.0f} MiB of shards "
            f"(overhead {overhead / MIB:.0f} MiB; the whole model is {r['whole'] / MIB:.0f} MiB)")


def test_the_355b_lightning_module_under_a_sharded_layout_allocates_no_parameters():
    """GLM46LitModule(glm46_355b, empty_init=True): 355B parameters on meta; the process stays under 1 GiB."""
    code = f"""
import resource
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from glm46.schema import register_configs
from glm46.train import build_module
register_configs()
with initialize_config_dir(config_dir="{ROOT / 'conf'}", version_base="1.3"):
    cfg = compose(config_name="config", overrides=["experiment=pretrain_phase1", "cluster=h800_1024n", "data.path=/x"])
module = build_module(cfg, OmegaConf.to_object(cfg.model))
assert all(p.is_meta for p in module.parameters())
print(sum(p.numel() for p in module.parameters()), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    parameters, peak = map(int, result.stdout.split()[-2:])
    assert parameters > 355e9
    assert peak < 2**30, f"peak RSS {peak / 2**30:.2f} GiB"


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
