"""The device mesh of a Layout, and its named sub-meshes.

One 7-D mesh over all ranks, dims MESH_DIMS = (pp, edp_replicate, ep_replicate, edp_shard, ep_shard, cp, tp),
outer to inner (pipeline stages outermost, as in torchtitan); the groups are flattened views of it:

| name | dims | what runs over it |
|---|---|---|
| `pp` | pp | pipeline stages: activations and their gradients point to point (glm46.parallel.pipeline_parallel) |
| `dp` | all but pp, cp and tp | data loading (rank and size), the balancer's count all-reduce |
| `dp_replicate` | (edp_replicate, ep_replicate) | FSDP2/HSDP of the non-expert weights: replicas |
| `dp_shard_cp` | (edp_shard, ep_shard, cp) | FSDP2/HSDP of the non-expert weights: shards |
| `ep` | (ep_replicate, ep_shard), cp, and tp when TP and EP fold | the experts' all-to-all; experts sharded on dim 0 |
| `edp_replicate`, `edp_shard` | themselves | FSDP2/HSDP of the expert weights (ranks holding the same experts) |
| `cp` | cp | context parallelism: K/V all-gathered, loss terms and expert counts summed |
| `tp` | tp | tensor parallelism |
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .layout import MESH_DIMS, Layout


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_DIMS)
    mesh[("edp_replicate", "ep_replicate", "edp_shard", "ep_shard")]._flatten("dp")
    mesh[("edp_replicate", "ep_replicate")]._flatten("dp_replicate")
    mesh[("edp_shard", "ep_shard", "cp")]._flatten("dp_shard_cp")
    ep = ("ep_replicate", "ep_shard") + (("cp",) if layout.expert_parallel > 1 else ())
    mesh[ep + (("tp",) if layout.experts_fold_tp else ())]._flatten("ep")
    return mesh


def hsdp_mesh(mesh: DeviceMesh, replicate: str, shard: str) -> DeviceMesh:
    """The mesh fully_shard takes: 1-D (FSDP) when nothing is replicated, else 2-D (replicate, shard) (HSDP)."""
    if mesh[replicate].size() == 1:
        return mesh[shard]
    return mesh[(replicate, shard)]
