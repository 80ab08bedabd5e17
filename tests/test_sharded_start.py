"""The sharded start without Lightning, on 4 gloo processes: a model built on meta allocates nothing; after
materialisation each rank's resident memory grows by its own shards plus a fixed overhead, never by the whole
model; the shards are initialised as replicas that agree and shards that differ; HF weights are read into the
shards from per-expert and fused files alike, and missing MTP weights are initialised on the shards.

Each run is its own set of processes (peak RSS is per process): `main` on 4 ranks forked from the preloaded server
(tests/ranks.py), gloo between them, each rank's peak reset before it builds. The memory overhead is measured, not
assumed: the same layout materialising a tiny model."""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from .ranks import run_ranks

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
# About 100M parameters (400 MiB in fp32): a whole copy on a rank is 2-4x the shards of these layouts.
LARGE = dict(
    vocab_size=16384,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=512,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    first_k_dense_replace=1,
    n_routed_experts=16,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)
TINY_SHARDED = dict(num_hidden_layers=3, n_routed_experts=8)  # tests.helpers.tiny_config with these
SMALL = dict(
    LARGE,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_routed_experts=4,
)
LAYOUTS = {
    "fsdp2": (-1, 1, 1),
    "ep": (1, 1, 4),
    "fsdp2_ep": (-1, 1, 2),
    "tp": (-1, 2, 1),  # shard, tp, ep
    "tp2_ep2": (2, 2, 2),
}  # experts over ep, replicated over tp: replicas to compare
MEASURED = ("fsdp2", "ep", "fsdp2_ep", "tp")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> None:
    """The peak so far becomes the resident size now (Linux's /proc/<pid>/clear_refs): a rank forked from the
    preloaded server (tests/ranks.py) starts with the peak of that server's imports, which would hide its growth."""
    Path("/proc/self/clear_refs").write_text("5")


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
    reset_peak_rss()
    before = peak_rss()
    with torch.device("meta"):
        model = GLM46ForCausalLM(GLM46Config(**spec["model"]))
    parallelize(model, layout, mesh)
    materialize(model, "cpu")
    grown = peak_rss() - before
    tensors = [*model.parameters(), *model.buffers()]
    local = sum((t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes() for t in tensors)
    whole = sum(t.numel() * t.element_size() for t in tensors)
    report = {"grown": grown, "local": local, "whole": whole}
    if spec.get("check"):
        report["pieces"] = pieces(model)
        for name, path in spec["check"].items():  # weights to read into the shards (init_from)
            from glm46.checkpoint.weights import load_weights
            from glm46.parallel.state import full_state_items

            load_weights(model, path)
            state = {k: None if t is None else t.clone() for k, t in full_state_items(model)}
            if dist.get_rank() == 0:
                torch.save(state, Path(spec["out"], f"{name}.pt"))
            report[f"{name}_pieces"] = pieces(model)
    Path(spec["out"], f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def pieces(model) -> dict[str, list]:
    """name -> [global offset of this rank's shard, a fingerprint of its values] for every sharded parameter."""
    from glm46.parallel.boxes import local_box, local_tensor

    result = {}
    for name, p in model.named_parameters():
        values = local_tensor(p).detach().double()
        offset = [s.start for s in local_box(p)]
        result[name] = [offset, values.numel(), values.sum().item(), values.pow(2).sum().item()]
    return result


def measure(tmp_path: Path, layout: str, model: dict, **spec) -> list[dict]:
    out = tmp_path / f"{layout}-{model['hidden_size']}"
    out.mkdir()
    run_ranks(main, {"layout": layout, "model": model, "out": str(out), **spec}, world_size=4, logs=out, timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", MEASURED)
def test_each_rank_holds_its_shards_plus_a_fixed_overhead(tmp_path, layout):
    overhead = max(r["grown"] - r["local"] for r in measure(tmp_path, layout, SMALL)) + 16 * MIB  # allocator slack
    for rank, r in enumerate(measure(tmp_path, layout, LARGE)):
        assert r["local"] < r["whole"] / 1.9, f"rank {rank}: the layout should shard most of the model"
        assert r["grown"] <= r["local"] + overhead, (
            f"rank {rank} grew {r['grown'] / MIB:.0f} MiB for {r['local'] / MIB:.0f} MiB of shards "
            f"(overhead {overhead / MIB:.0f} MiB; the whole model is {r['whole'] / MIB:.0f} MiB)"
        )


def fused(source: Path, target: Path) -> Path:
    """The same checkpoint with each layer's experts stacked under one key (transformers v5's fused layout)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(source / "model.safetensors")
    stacks: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key in [k for k in tensors if ".mlp.experts." in k]:
        prefix, expert, part = re.match(r"^(.+\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight$", key).groups()
        stacks.setdefault(prefix, {}).setdefault(int(expert), {})[part] = tensors.pop(key)
    for prefix, experts in stacks.items():
        order = [experts[e] for e in sorted(experts)]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([e["gate"], e["up"]]) for e in order])
        tensors[f"{prefix}.down_proj"] = torch.stack([e["down"] for e in order])
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    save_file(tensors, target / "model.safetensors")
    return target


def without_mtp(source: Path, target: Path, num_layers: int) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(source / "model.safetensors")
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith(f"model.layers.{num_layers}.")},
        target / "model.safetensors",
    )
    return target


def assert_replicas_agree_and_shards_differ(ranks: list[dict], key: str) -> None:
    for name in ranks[0][key]:
        by_offset: dict[tuple, list] = {}
        for r in ranks:
            offset, numel, total, squares = r[key][name]
            if numel:
                by_offset.setdefault(tuple(offset), []).append((total, squares))
        for offset, values in by_offset.items():
            assert all(v == values[0] for v in values), f"{name}: replicas of the shard at {offset} differ"
        sums = [values[0] for values in by_offset.values()]
        if len(sums) > 1 and not name.endswith(("norm.weight", "bias")):  # drawn weights: every shard its own
            assert len(set(sums)) == len(sums), f"{name}: different shards hold the same numbers"


@pytest.mark.distributed
@pytest.mark.slow
def test_shards_initialise_consistently_and_read_weights_of_every_kind(tmp_path):
    """TP 2 x EP 2 x FSDP 2 on 4 ranks: experts are replicated over TP, so replicas exist to compare. Per-expert
    and fused HF checkpoints and a Lightning .ckpt give exactly one process's load_hf; a checkpoint without MTP
    weights gets MTP layers initialised on the shards, replicas agreeing."""
    import torch

    from glm46.hf import load_hf, save_hf
    from tests.helpers import random_model, tiny_config

    model = dict(TINY_SHARDED)
    per_expert = save_hf(random_model(tiny_config(**model), seed=3), tmp_path / "per_expert")
    checkpoint = tmp_path / "last.ckpt"  # a Lightning checkpoint file, memory-mapped by every rank
    torch.save({"state_dict": {f"model.{k}": v for k, v in load_hf(per_expert).state_dict().items()}}, checkpoint)
    sources = {
        "per_expert": str(per_expert),
        "fused": str(fused(per_expert, tmp_path / "fused")),
        "ckpt": str(checkpoint),
        "no_mtp": str(without_mtp(per_expert, tmp_path / "no_mtp", model["num_hidden_layers"])),
    }
    ranks = measure(tmp_path, "tp2_ep2", tiny_config(**model).__dict__, check=sources)
    assert_replicas_agree_and_shards_differ(ranks, "pieces")
    assert_replicas_agree_and_shards_differ(ranks, "no_mtp_pieces")
    expected = load_hf(per_expert).state_dict()
    out = tmp_path / "tp2_ep2-64"
    for name in ("per_expert", "fused", "ckpt"):
        loaded = torch.load(out / f"{name}.pt")
        for key, tensor in expected.items():
            assert torch.equal(loaded[key], tensor), f"{name}: {key}"
    no_mtp = torch.load(out / "no_mtp.pt")
    assert all(torch.equal(no_mtp[k], t) for k, t in expected.items() if not k.startswith("mtp_layers."))
    assert not torch.equal(no_mtp["mtp_layers.0.eh_proj.weight"], expected["mtp_layers.0.eh_proj.weight"])


def test_the_355b_lightning_module_under_a_sharded_layout_allocates_no_parameters():
    """GLM46LitModule(glm46_355b, empty_init=True): 355B parameters on meta; the process allocates under 1 GiB."""
    code = f"""
import resource
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from glm46.config.schema import register_configs
from glm46.app.train import build_module
register_configs()
with initialize_config_dir(config_dir="{ROOT / "conf"}", version_base="1.3"):
    cfg = compose(config_name="config", overrides=["experiment=pretrain_phase1", "cluster=h800_1024n", "data.path=/x"])
module = build_module(cfg, OmegaConf.to_object(cfg.model))
assert all(p.is_meta for p in module.parameters())
anonymous = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:"))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(sum(p.numel() for p in module.parameters()), peak, anonymous * 1024)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    parameters, peak, anonymous = map(int, result.stdout.split()[-3:])
    assert parameters > 355e9
    # Allocated memory (anonymous pages: tensors, Python objects) stays under 1 GiB with the module alive. The peak
    # RSS also counts pages of the shared libraries mapped from the page cache, which varies with what ran before
    # (measured 0.6 GiB alone, 1.14 GiB once in the full suite): reported, bounded loosely.
    assert anonymous < 2**30, f"anonymous RSS {anonymous / 2**30:.2f} GiB (peak RSS {peak / 2**30:.2f} GiB)"
    assert peak < 2 * 2**30, f"peak RSS {peak / 2**30:.2f} GiB"
