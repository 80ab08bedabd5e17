"""Parallel layouts at composition: every conf/parallelism member composes and validates, and the
rules name their keys and numbers (no processes started)."""

import pytest
from omegaconf import OmegaConf

from glm46.config.layout_checks import check_layout
from glm46.config.schema import register_configs  # noqa: F401  (conftest registers; kept for direct runs)
from glm46.config.schema.launch import DeepSpeedParallelism, ParallelismConfig
from glm46.errors import ConfigError
from glm46.lit.strategies import build_strategy
from glm46.parallel import Layout
from glm46.parallel.layout import model_problems

from .helpers import tiny_config


def layout_of(world: int, model=None, deepspeed: bool = False, **keys) -> Layout:
    """Layout.from_config of a typed `parallelism` node with `keys`, then the model against it, as checks does."""
    schema = DeepSpeedParallelism(stage=3) if deepspeed else ParallelismConfig()
    node = OmegaConf.merge(OmegaConf.structured(schema), keys)
    layout = Layout.from_config(node, world)
    problems = model_problems(layout, model or tiny_config())
    if problems:
        raise ConfigError("; ".join(problems))
    return layout


# member -> (world size it is meant for, model), the sizes its test (or the plan) runs it at
MEMBERS = {
    "single": (1, "tiny"),
    "ddp": (2, "tiny"),
    "fsdp2": (2, "tiny"),
    "ep": (2, "tiny"),
    "tp": (2, "tiny"),
    "fsdp2_ep": (4, "tiny"),
    "deepspeed_zero3": (2, "tiny"),
    "production": (1024 * 8, "glm46_355b"),
    "pp": (2, "tiny"),
}


@pytest.mark.parametrize("member", sorted(MEMBERS))
def test_every_parallelism_member_composes_and_validates(compose_config, member):
    world, model = MEMBERS[member]
    optim = "adamw" if member.startswith("deepspeed") else "muon"
    cfg = compose_config(f"parallelism={member}", f"model={model}", f"optim={optim}")
    config = OmegaConf.to_object(cfg.model)
    layout = Layout.from_config(cfg.parallelism, world)
    check_layout(cfg, config, layout)
    assert cfg.parallelism.name == member
    assert layout.pipeline_parallel == cfg.parallelism.pipeline_parallel and layout.engine == cfg.parallelism.engine
    strategy = build_strategy(cfg.parallelism, layout)  # the strategy is built, with the Layout for the mesh's
    assert strategy == "auto" if member == "single" else type(strategy).__name__.endswith("Strategy")
    if layout.engine == "mesh":
        assert strategy.layout is layout


def test_the_production_layout_is_the_seeds_tp8_x_pp16_x_ep32(compose_config):
    from glm46.parallel.pipeline_parallel import split_layers

    cfg = compose_config("parallelism=production", "model=glm46_355b")
    layout = Layout.from_config(cfg.parallelism, 1024 * 8)
    assert (layout.tensor_parallel, layout.pipeline_parallel, layout.expert_parallel) == (8, 16, 32)
    assert layout.data_parallel == 64 and layout.data_parallel_shard == 64
    assert layout.experts_fold_tp and layout.expert_parallel_dp == 4 and layout.expert_data_parallel == 16
    config = OmegaConf.to_object(cfg.model)
    ranges = split_layers(config, layout.num_stages)  # 32 stages: every layer on exactly one, in order
    assert [i for r in ranges for i in r] == list(range(config.num_hidden_layers)) and min(map(len, ranges)) >= 1
    assert len(ranges[-1]) < len(ranges[len(ranges) // 2])  # the last stage also runs the lm_head and MTP


@pytest.mark.parametrize(
    "keys, world, message",
    [
        ({"tensor_parallel": 3}, 6, r"num_attention_heads=4 must be divisible by parallelism.tensor_parallel=3"),
        ({"tensor_parallel": 4}, 4, r"num_key_value_heads=2 must be divisible by parallelism.tensor_parallel=4"),
        ({"expert_parallel": 3}, 3, r"n_routed_experts=8 must be divisible by parallelism.expert_parallel=3"),
        ({"tensor_parallel": 2}, 3, r"world size 3 .* must be divisible by parallelism.tensor_parallel=2"),
        ({"expert_parallel": 4}, 2, r"world size 2 must be divisible by tensor_parallel x expert_parallel = 1 x 4"),
        (
            {"tensor_parallel": 2, "expert_parallel": 3},
            6,
            r"expert_parallel=3 must be a multiple of tensor_parallel=2: the experts fold over the tensor-parallel",
        ),
        (
            {"tensor_parallel": 2, "expert_parallel": 8},
            4,
            r"the 2 data-parallel ranks .* must be divisible by expert_parallel / tensor_parallel = 8 / 2 = 4",
        ),
        ({"data_parallel_shard": 3}, 4, r"data_parallel_shard=3 must divide the data-parallel size"),
        (
            {"data_parallel_shard": 4, "expert_parallel": 6},
            12,
            r"expert_parallel=6 and data_parallel_shard=4 must divide",
        ),
        ({"pipeline_parallel": 2}, 2, r"microbatches=1 must be >= pipeline_parallel=2 for 1F1B"),
        (
            {"pipeline_parallel": 2, "microbatches": 2, "pipeline_schedule": "Interleaved1F1B"},
            2,
            r"virtual_stages=1: pipeline_schedule=Interleaved1F1B runs 2 or more stages per rank",
        ),
        ({"pipeline_parallel": 4, "microbatches": 4}, 4, r"model.num_hidden_layers=3 do not split into .* 4 stages"),
        (
            {
                "pipeline_parallel": 2,
                "microbatches": 4,
                "pipeline_schedule": "ZBVZeroBubble",
                "virtual_stages": 2,
                "reshard_after_forward": True,
            },
            2,
            r"reshard_after_forward=true: ZBVZeroBubble takes the weights' gradients after the inputs'",
        ),
        (
            {"pipeline_parallel": 2, "microbatches": 2, "layers_per_stage": [2, 2]},
            2,
            r"layers_per_stage=\[2, 2\] must give each of the 2 stages at least one layer and add up to",
        ),
        (
            {"pipeline_parallel": 2, "microbatches": 2},
            3,
            r"world size 3 .* tensor_parallel x pipeline_parallel = 1 x 2",
        ),
        ({"mixed_precision": {"param_dtype": "bf16"}}, 2, r"mixed_precision.param_dtype='bf16' is not one of"),
    ],
)
def test_mesh_layouts_that_cannot_run_name_their_keys(keys, world, message):
    with pytest.raises(ConfigError, match=message):
        layout_of(world, **{"name": "fsdp2", "engine": "mesh", "data_parallel_shard": -1, **keys})


def test_fsdp2_keeps_layers_gathered_under_pipeline_parallelism_unless_told():
    """torchtitan's default: a stage would gather its layers again for each microbatch."""
    assert Layout(2, data_parallel_shard=2).reshards_after_forward
    assert not Layout(4, data_parallel_shard=2, pipeline_parallel=2).reshards_after_forward
    assert Layout(4, data_parallel_shard=2, pipeline_parallel=2, reshard_after_forward=True).reshards_after_forward
    assert not Layout(2, data_parallel_shard=2, reshard_after_forward=False).reshards_after_forward


def test_engines_without_a_mesh_refuse_mesh_sizes_and_deepspeed_refuses_muon(compose_config):
    with pytest.raises(ConfigError, match=r"engine=ddp cannot split tensors or experts: tensor_parallel=2"):
        layout_of(2, name="ddp", engine="ddp", tensor_parallel=2)
    with pytest.raises(ConfigError, match=r"parallelism=single runs one process, but the cluster has world size 2"):
        layout_of(2, name="single", engine="single")
    with pytest.raises(ConfigError, match=r"activation_checkpointing=true is applied by engine=mesh"):
        layout_of(2, name="ddp", engine="ddp", activation_checkpointing=True)
    assert layout_of(2, deepspeed=True, name="deepspeed_zero3", engine="deepspeed", data_parallel_shard=-1)
    cfg = compose_config("experiment=tiny_bytes", "parallelism=deepspeed_zero3", "cluster.devices=2")  # Muon
    with pytest.raises(ConfigError, match=r"Muon's Newton-Schulz needs whole matrices; use optim=adamw"):
        check_layout(cfg, tiny_config(), Layout.from_config(cfg.parallelism, 2))


@pytest.mark.parametrize(
    "world, tp, ep, shard, pp, cp, shape",
    [
        (2, 1, 1, 2, 1, 1, (1, 1, 1, 2, 1, 1, 1)),  # fsdp2
        (2, 1, 2, 1, 1, 1, (1, 1, 2, 1, 1, 1, 1)),  # ep, replicated (DDP-like)
        (4, 1, 2, 4, 1, 1, (1, 1, 1, 2, 2, 1, 1)),  # fsdp2 x ep: experts FSDP over 2
        (4, 2, 2, 2, 1, 1, (1, 1, 1, 2, 1, 1, 2)),  # tp x ep: the ep group is the tp group, experts FSDP over 2
        (16, 1, 4, 2, 1, 1, (1, 4, 2, 1, 2, 1, 1)),  # HSDP, ep spanning two shard groups
        (8192, 8, 32, 1024, 1, 1, (1, 1, 1, 256, 4, 1, 8)),  # FSDP-only production: ep 32 = 4 dp x 8 tp
        (4, 1, 2, 2, 2, 1, (2, 1, 1, 1, 2, 1, 1)),  # pp 2 x ep 2
        (8192, 8, 32, 64, 16, 1, (16, 1, 1, 16, 4, 1, 8)),  # the seeds' TP 8 x PP 16 x EP 32 (4 dp x 8 tp)
        (16, 2, 8, 2, 1, 1, (1, 2, 2, 1, 2, 1, 2)),  # tp x HSDP, ep spanning two shard groups and the tp ranks
        (4, 1, 1, 2, 1, 2, (1, 1, 1, 2, 1, 2, 1)),  # fsdp2 x cp 2: weights sharded over the 4 ranks
        (16, 2, 4, 2, 1, 2, (1, 2, 1, 2, 1, 2, 2)),  # tp 2 x cp 2 x ep 4: an ep group is one cp x tp block
        (16, 1, 4, 4, 1, 2, (1, 2, 1, 2, 2, 2, 1)),  # cp 2 x ep 4: ep spans 2 data-parallel ranks x 2 cp ranks, HSDP
    ],
)
def test_mesh_shape_places_ep_inside_the_data_parallel_and_tensor_parallel_ranks(world, tp, ep, shard, pp, cp, shape):
    """ep takes ep / tp data-parallel coordinates when TP is on (the groups fold over the tp ranks), else ep; the cp
    ranks lie between the data-parallel ranks and tp, outside the ep groups."""
    layout = Layout(world, tp, ep, shard, pipeline_parallel=pp, context_parallel=cp)
    assert layout.mesh_shape == shape
    stages, edp_replicate, ep_replicate, edp_shard, ep_shard, context, tensor = shape
    assert context == cp and layout.data_parallel * tp * pp * cp == world
    assert ep_replicate * ep_shard * (tensor * context if ep > 1 else 1) == ep and tensor == tp and stages == pp
    assert edp_replicate * edp_shard == layout.expert_data_parallel
    assert edp_shard * ep_shard == shard
