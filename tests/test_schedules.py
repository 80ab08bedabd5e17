"""Token-driven schedules at chosen token counts, and the GLM-4.5 schedule config resolved for a run."""

import math

import pytest
from hydra.utils import instantiate

from glm46.optim import LinearRamp, Piecewise, WarmupCosine, WarmupStableDecay
from glm46.optim.schedules import accumulation_for


def test_warmup_cosine_glm45_values():
    lr = 2.5e-4  # the optimizer's; the schedule is a factor of it, with GLM-4.5's floor of 2.5e-5
    s = WarmupCosine(warmup_tokens=1000, total_tokens=11000, min_factor=0.1)
    assert s(0) == 0.0
    assert lr * s(500) == pytest.approx(1.25e-4)
    assert lr * s(1000) == pytest.approx(2.5e-4)
    assert lr * s(6000) == pytest.approx(2.5e-5 + 0.5 * (2.5e-4 - 2.5e-5))  # half-way down the cosine
    assert lr * s(11000) == pytest.approx(2.5e-5)
    assert lr * s(50000) == pytest.approx(2.5e-5)
    scaled = WarmupCosine(warmup_tokens=1000, total_tokens=11000, min_factor=0.1, scale=0.01)  # an RL stage
    assert [scaled(t) for t in (500, 6000, 50000)] == pytest.approx([0.01 * s(t) for t in (500, 6000, 50000)])


def test_wsd_values():
    s = WarmupStableDecay(warmup_tokens=10, total_tokens=100, decay_tokens=20, min_factor=0.1)
    assert [s(5), s(10), s(79), s(90), s(100), s(200)] == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.1, 0.1])


def test_an_lr_factor_outside_its_range_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"schedule\.lr\.min_factor=1\.5 must be in \[0, 1\]"):
        WarmupCosine(warmup_tokens=0, total_tokens=1, min_factor=1.5)
    with pytest.raises(ValueError, match=r"schedule\.lr\.scale=0 \(phase\.lr_scale\) must be > 0"):
        WarmupStableDecay(warmup_tokens=0, total_tokens=1, decay_tokens=1, scale=0)


def test_piecewise_mtp_weight_and_balancer_rate():
    mtp = Piecewise(values=[0.3, 0.1], boundaries=[15 * 10**12])
    assert mtp(0) == 0.3 and mtp(15 * 10**12 - 1) == 0.3 and mtp(15 * 10**12) == 0.1 and mtp(23 * 10**12) == 0.1
    with pytest.raises(ValueError, match="one more value"):
        Piecewise(values=[1.0], boundaries=[5])
    with pytest.raises(ValueError, match="increasing"):
        Piecewise(values=[1.0, 2.0, 3.0], boundaries=[5, 2])


def test_batch_size_ramp_glm45():
    ramp = LinearRamp(start=16 * 2**20, end=64 * 2**20, ramp_tokens=500 * 10**9)
    assert ramp(0) == 16 * 2**20
    assert ramp(250 * 10**9) == pytest.approx(40 * 2**20)
    assert ramp(10**13) == 64 * 2**20


def test_a_run_off_the_recipes_clock_scales_its_positions_to_its_own_tokens(compose_config):
    # experiment=toy_recipe: the toy clock without the default run's copy drill in front, so that the switch falls
    # where GLM-4.5's does
    small = ["experiment=toy_recipe", "trainer.max_steps=1000", "data.batch_size=4", "data.seq_len=128"]
    cfg = compose_config(*small)
    run_tokens = 1000 * 4 * 128
    assert cfg.phase.name == "toy_rl" and cfg.phase.name not in cfg.recipe.phases  # RL: a clock of its own
    assert cfg.schedule.run_tokens == run_tokens and cfg.schedule.start_tokens == 0
    lr = instantiate(cfg.schedule.lr)
    assert lr.total_tokens == run_tokens and lr.scale == cfg.phase.lr_scale < 1  # the default run ends with RL, lower
    assert instantiate(compose_config("phase=toy_sft", "data=embedded_sft").schedule.lr).scale == 1.0
    share = run_tokens / cfg.recipe.tokens  # the recipe's positions, scaled to the run
    assert lr.warmup_tokens == round(cfg.recipe.warmup_tokens * share)
    # RL is post-training (recipe.post_training): past the switch from its first token
    assert instantiate(cfg.schedule.mtp_weight).boundaries == [0]
    assert instantiate(cfg.callbacks.expert_balancer.rate)(0) == 0.0
    # any other run off the clock (a quick run, a sweep) meets the switch where the recipe does, scaled
    quick = compose_config(*small, "recipe.post_training=[]")
    mtp = instantiate(quick.schedule.mtp_weight)
    assert mtp.boundaries == [round(cfg.recipe.switch_tokens * share)] and mtp.values == [0.3, 0.1]
    assert 0.64 < mtp.boundaries[0] / run_tokens < 0.66  # at GLM-4.5's 15T of 23.1T
    rate = instantiate(quick.callbacks.expert_balancer.rate)
    assert rate(0) > 0 and rate(run_tokens) == 0.0


def test_wsd_schedule_member_composes(compose_config):
    cfg = compose_config("schedule=wsd", "trainer.max_steps=100", "data.batch_size=2", "data.seq_len=10")
    lr = instantiate(cfg.schedule.lr)
    assert isinstance(lr, WarmupStableDecay) and lr.decay_tokens == 400 and lr.total_tokens == 2000
    assert lr.min_factor == 0.1 and lr.scale == cfg.phase.lr_scale  # glm45's, not the WSD signature's defaults


def test_batch_warmup_callbacks_member_ramps_a_quarter_to_the_full_batch(compose_config):
    cfg = compose_config("callbacks=batch_warmup", "trainer.max_steps=100", "data.batch_size=8", "data.seq_len=16")
    ramp = instantiate(cfg.callbacks.batch_size_warmup).tokens_per_step
    assert accumulation_for(ramp, 0, micro_batch_tokens=2 * 16) == 1
    assert accumulation_for(ramp, 10**9, micro_batch_tokens=2 * 16) == 4
    assert ramp.ramp_tokens == cfg.schedule.batch_warmup_tokens  # the recipe's 500B of 23.1T, scaled to the run
    assert "expert_balancer" in cfg.callbacks


@pytest.mark.parametrize(
    "experiment, seq_len, rope_theta, packing, tokens",
    [
        ("pretrain_phase1", 4096, 10_000.0, "truncate", 15 * 10**12),
        ("pretrain_phase2", 4096, 10_000.0, "truncate", 7 * 10**12),
        ("midtrain phase=midtrain_repo", 32768, 1_000_000.0, "best_fit", 500 * 10**9),
        ("midtrain phase=midtrain_reasoning", 32768, 1_000_000.0, "best_fit", 500 * 10**9),
        ("midtrain phase=midtrain_long", 131072, 1_000_000.0, "best_fit", 100 * 10**9),
    ],
)
def test_glm45_phases_set_sequence_rope_packing_and_steps(
    compose_config, experiment, seq_len, rope_theta, packing, tokens
):
    cfg = compose_config(
        *f"experiment={experiment}".split(), "cluster=h800_1024n", "data.path=/data", "init_from=/ckpt"
    )
    assert (cfg.data.seq_len, cfg.model.rope_theta, cfg.data.packing) == (seq_len, rope_theta, packing)
    assert cfg.model.max_position_embeddings == 202752
    # the phase's global batch (64M tokens; 128M at 128K) per optimizer step, whatever the cluster
    steps = math.ceil(tokens / cfg.phase.global_batch_tokens)
    if experiment == "pretrain_phase1":  # the batch-size warm-up's smaller steps come first
        assert steps < cfg.trainer.max_steps < steps * 1.05
    else:
        assert cfg.trainer.max_steps == steps
    assert cfg.phase.global_batch_tokens == (134_217_728 if seq_len == 131072 else 67_108_864)


def test_a_sequence_longer_than_the_model_allows_is_refused(compose_config):
    from glm46.config.checks import validate
    from glm46.errors import ConfigError

    cfg = compose_config(
        "experiment=midtrain",
        "phase=midtrain_long",
        "cluster=h800_1024n",
        "data.path=/data",
        "init_from=/ckpt",
        "phase.seq_len=300000",
    )
    with pytest.raises(ConfigError, match="data.seq_len=300000 exceeds model.max_position_embeddings=202752"):
        validate(cfg)


def test_the_lr_is_stated_once_in_optim_lr(compose_config):
    """DESIGN's sweep spelling: `optim.lr` sets the optimizer's LR, and the schedules scale that."""
    cfg = compose_config("experiment=smoke", "optim.lr=1e-3", "model.n_routed_experts=8")
    assert cfg.optim.optimizer.lr == 1e-3 and instantiate(cfg.optim.optimizer).keywords["lr"] == 1e-3
    assert compose_config("experiment=smoke", "optim=adamw", "optim.lr=2e-3").optim.optimizer.lr == 2e-3
