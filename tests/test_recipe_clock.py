"""The recipe on one token clock: the production phases continue each other's schedules as GLM-4.5 trains them
(one LR warm-up and one cosine to the floor at the end of mid-training, the switches once at 15T, the global batch
16M -> 64M over the first 500B tokens), a phase is refused out of its place, and real runs (a phase started with
`init_from`, a resume mid-phase under the batch-size warm-up) land on the same curves."""

import csv
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glm46.config.checks import validate
from glm46.errors import ConfigError
from glm46.optim.schedules import recipe_values

from .helpers import SHORT_RUN, UNKILLED, kill_at, run_py

ROOT = Path(__file__).resolve().parents[1]
T = 10**12
M = 2**20
PHASES = [  # GLM-4.5's pre-training and mid-training in order (arXiv:2508.06471, Fig. 3)
    ("pretrain_phase1", "pretrain1", 0, 15 * T),
    ("pretrain_phase2", "pretrain2", 15 * T, 7 * T),
    ("midtrain", "midtrain_repo", 22 * T, T // 2),
    ("midtrain", "midtrain_reasoning", 22 * T + T // 2, T // 2),
    ("midtrain", "midtrain_long", 23 * T, T // 10),
]
PRODUCTION = ("cluster=h800_1024n", "data.path=/data", "init_from=/ckpt")
PLAN = "task=plan"  # the checks without the memory fit, which midtrain_long's 128K misses until context parallelism


@pytest.fixture(scope="module")
def production():
    """The five production phases composed as a user submits them: phase -> config."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from glm46.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        configs = {
            phase: compose("config", overrides=[f"experiment={experiment}", f"phase={phase}", *PRODUCTION, PLAN])
            for experiment, phase, _, _ in PHASES
        }
    GlobalHydra.instance().clear()
    return configs


def test_each_phase_starts_where_the_phases_before_it_end(production):
    for _, phase, start, tokens in PHASES:
        cfg = production[phase]
        assert (cfg.schedule.start_tokens, cfg.phase.tokens, cfg.schedule.scale) == (start, tokens, 1.0)
        assert cfg.schedule.end_tokens == 23_100_000_000_000  # one cosine, to the end of mid-training
        validate(cfg)  # every phase of the recipe composes and passes the recipe's checks at the real cluster size


def test_the_lr_runs_one_warmup_and_one_cosine_through_every_phase(production):
    first = recipe_values(production["pretrain1"], 0)
    assert first["lr"] == 0.0  # one warm-up from 0, at the start of pre-training only
    assert recipe_values(production["pretrain1"], 500 * 10**9)["lr"] == pytest.approx(2.5e-4)  # the peak
    floor = 2.5e-5
    for (_, before, _, tokens), (_, after, _, _) in zip(PHASES, PHASES[1:]):
        end = recipe_values(production[before], tokens - 1)["lr"]
        start = recipe_values(production[after], 0)["lr"]
        assert start == pytest.approx(end, rel=0.01), f"{before} -> {after}: LR jumps {end:.3g} -> {start:.3g}"
        assert end > floor * 1.0001, f"the floor is reached before the end of mid-training ({before})"
    assert recipe_values(production["midtrain_long"], T // 10)["lr"] == pytest.approx(floor)
    # no phase restarts the warm-up: phase 2 starts far down the cosine, not at 0 or at the peak
    assert 5e-5 < recipe_values(production["pretrain2"], 0)["lr"] < 1.5e-4


def test_mtp_weight_and_balancer_rate_switch_once_at_15t(production):
    phase1, phase2 = production["pretrain1"], production["pretrain2"]
    late_phase1 = recipe_values(phase1, 15 * T - 1)
    assert (late_phase1["mtp_weight"], late_phase1["balancer_rate"]) == (0.3, 0.001)  # not 9.75T (0.65 of 15T)
    for cfg in (phase2, production["midtrain_repo"], production["midtrain_long"]):
        start = recipe_values(cfg, 0)
        assert (start["mtp_weight"], start["balancer_rate"]) == (0.1, 0.0)  # no reset to 0.3 / 0.001


def test_the_global_batch_warms_up_16m_to_64m_over_500b_tokens(production):
    phase1 = production["pretrain1"]
    assert recipe_values(phase1, 0)["global_batch_tokens"] == 16 * M
    middle = recipe_values(phase1, 250 * 10**9)["global_batch_tokens"]
    assert 36 * M <= middle <= 44 * M  # linear: 40M half-way, in whole micro-batches of 4M
    for tokens in (500 * 10**9, 501 * 10**9, 15 * T - 1):
        assert recipe_values(phase1, tokens)["global_batch_tokens"] == 64 * M
    assert recipe_values(production["pretrain2"], 0)["global_batch_tokens"] == 64 * M
    # the warm-up's smaller steps are counted: 15T at 64M alone would be 223,518 steps
    assert phase1.trainer.max_steps > 15 * T / (64 * M) + 0.5 * 500 * 10**9 / (64 * M)
    assert production["pretrain2"].trainer.max_steps == -(-7 * T // (64 * M))


def test_post_training_keeps_a_clock_of_its_own(compose_config):
    for experiment in ("sft", "rl"):
        cfg = compose_config(f"experiment={experiment}", *PRODUCTION)
        assert cfg.schedule.start_tokens == 0 and cfg.schedule.end_tokens == cfg.schedule.run_tokens
        assert recipe_values(cfg, 0)["lr"] == 0.0 and "batch_size_warmup" not in cfg.callbacks
        # it continues from the recipe's post-switch values: the MTP weight at 0.1, the correction bias frozen
        for tokens in (0, cfg.schedule.run_tokens // 2, cfg.schedule.run_tokens):
            values = recipe_values(cfg, tokens)
            assert (values["mtp_weight"], values["balancer_rate"]) == (0.1, 0.0), (experiment, tokens)


def test_the_toy_recipe_stages_share_one_lr_curve(compose_config):
    phases = ("toy_pretrain1", "toy_pretrain2", "toy_midtrain")
    stages = [compose_config("experiment=toy_stage", f"phase={phase}") for phase in phases]
    for before, after in zip(stages, stages[1:]):
        assert after.schedule.start_tokens == before.schedule.start_tokens + before.phase.tokens
        end, start = recipe_values(before, before.phase.tokens - 1)["lr"], recipe_values(after, 0)["lr"]
        assert start == pytest.approx(end, rel=0.01)
    last = stages[-1]
    floor = last.optim.optimizer.lr * last.schedule.lr.min_factor
    assert recipe_values(last, last.phase.tokens)["lr"] == pytest.approx(floor)
    sft = compose_config("experiment=toy_stage", "phase=toy_sft", "data=embedded_sft")
    assert sft.schedule.start_tokens == 0 and recipe_values(sft, 0)["lr"] == 0.0  # SFT warms up on its own
    assert (recipe_values(sft, 0)["mtp_weight"], recipe_values(sft, 0)["balancer_rate"]) == (0.1, 0.0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ("experiment=pretrain_phase2", "schedule.start_tokens=0"),
            r"schedule.start_tokens=0 contradicts the phases before phase=pretrain2 .*recipe.phases.pretrain1="
            r"15000000000000\): it starts at 15000000000000",
        ),
        (
            ("experiment=pretrain_phase2", "phase.tokens=5000000000000"),
            r"phase.tokens=5000000000000 but recipe.phases.pretrain2=7000000000000",
        ),
        (
            ("experiment=pretrain_phase1", "recipe.warmup_tokens=16000000000000"),
            r"recipe.warmup_tokens=16000000000000: a warm-up longer than the recipe's first phase "
            r"\(recipe.phases.pretrain1=15000000000000\)",
        ),
        (
            ("experiment=pretrain_phase1", "recipe.batch_warmup_tokens=20000000000000"),
            r"recipe.batch_warmup_tokens=20000000000000: a warm-up longer",
        ),
    ],
)
def test_a_phase_out_of_its_place_is_refused_naming_the_keys(compose_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(*overrides, *PRODUCTION, "parallelism=production"))


def test_a_shortened_phase_is_told_that_its_schedules_stay_on_the_clock(compose_config, caplog):
    validate(compose_config("experiment=toy_stage", "phase=toy_pretrain2", "trainer.max_steps=4"))
    assert (
        "trainer.max_steps=4, but phase toy_pretrain2 has 122,880 tokens on the recipe's clock (60 steps)"
        in caplog.text
    )
    caplog.clear()
    validate(compose_config("experiment=toy_stage", "phase=toy_pretrain2"))
    assert "trainer.max_steps" not in caplog.text


def test_a_smaller_recipe_moves_every_later_phase(compose_config):
    smaller = "recipe.phases.pretrain1=8000000000000"
    cfg = compose_config("experiment=midtrain", "phase=midtrain_long", smaller, *PRODUCTION, PLAN)
    assert cfg.schedule.start_tokens == 16 * T and cfg.schedule.end_tokens == 16_100_000_000_000
    assert cfg.schedule.switch_tokens == 8 * T  # the switch follows the end of stage 1
    validate(cfg)


# --- real runs: a phase from init_from, a resume in the batch-size warm-up ------------------------------------------

# A toy clock of 2048 + 1024 + 512 tokens; micro-batches of 2 x 32 tokens; the global batch ramps 64 -> 256 tokens
# (1 -> 4 micro-batches) over the first 512 tokens; a checkpoint every 2 steps; every step logged.
CLOCK = [
    *SHORT_RUN,
    "recipe=toy",
    "recipe.phases.toy_pretrain1=2048",
    "recipe.phases.toy_pretrain2=1024",
    "recipe.phases.toy_midtrain=512",
    "recipe.warmup_tokens=256",
    "recipe.switch_tokens=2560",
    "recipe.batch_warmup_tokens=512",
    "callbacks=batch_warmup",
    "trainer.accumulate_grad_batches=4",
    "trainer.max_steps='${phase_steps:${phase.tokens},${callbacks.batch_size_warmup.tokens_per_step},"
    "${schedule.start_tokens},${global_batch_tokens},${trainer.accumulate_grad_batches}}'",  # as pretrain_phase1's
]
PHASE_A = ["phase=toy_pretrain1", "phase.tokens=2048"]
PHASE_B = ["phase=toy_pretrain2", "phase.tokens=1024"]


def run(run_dir: Path, *overrides: str, killed: bool = False) -> None:
    run_py(*CLOCK, f"hydra.run.dir={run_dir}", *overrides, killed=killed)


def steps(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> its logged values (the last row per step: a resumed run appends the steps it repeats)."""
    rows: dict[int, dict[str, float]] = {}
    with open(run_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            values = {k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"}
            rows.setdefault(int(row["step"]), {}).update(values)
    return rows


def assert_on_the_recipe_curves(cfg, logged: dict[int, dict[str, float]]) -> None:
    """Every step's LR, MTP weight and global batch are recipe_values at the tokens seen before it."""
    micro_batch_tokens = 2 * 32
    before = 0
    for step in sorted(logged):
        values = recipe_values(cfg, before)
        row = logged[step]
        assert row["optim/lr"] == pytest.approx(values["lr"], rel=1e-5), step
        assert row["train/mtp_weight"] == pytest.approx(values["mtp_weight"]), step
        assert row["train/accumulate_grad_batches"] * micro_batch_tokens == values["global_batch_tokens"], step
        before = int(row["train/tokens_seen"])
    assert before >= cfg.phase.tokens > before - values["global_batch_tokens"]  # spends its tokens, to the step


@pytest.fixture(scope="module")
def phase_a(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("phase_a")
    run(run_dir, *PHASE_A)
    return run_dir


@pytest.mark.slow
def test_a_phase_under_the_batch_warmup_follows_the_recipe_curves(phase_a, compose_config):
    cfg = compose_config(*CLOCK, *PHASE_A)
    logged = steps(phase_a)
    assert len(logged) == cfg.trainer.max_steps
    accumulation = [int(row["train/accumulate_grad_batches"]) for _, row in sorted(logged.items())]
    assert accumulation[0] == 1 and accumulation[-1] == 4 and accumulation == sorted(accumulation)
    assert_on_the_recipe_curves(cfg, logged)


@pytest.mark.slow
def test_the_next_phase_from_init_from_continues_the_clock(phase_a, compose_config, tmp_path):
    run(tmp_path, *PHASE_B, f"init_from={phase_a / 'hf'}")
    cfg = compose_config(*CLOCK, *PHASE_B)
    assert cfg.schedule.start_tokens == 2048
    logged, previous = steps(tmp_path), steps(phase_a)
    assert_on_the_recipe_curves(cfg, logged)
    last_a, first_b = previous[max(previous)]["optim/lr"], logged[min(logged)]["optim/lr"]
    phase_a_curve = recipe_values(compose_config(*CLOCK, *PHASE_A), 2048)["lr"]  # phase A's curve, one step on
    assert first_b < last_a and first_b == pytest.approx(phase_a_curve, rel=1e-6)  # on down the cosine, no restart
    weights = [logged[step]["train/mtp_weight"] for step in (min(logged), max(logged))]
    assert weights == pytest.approx([0.3, 0.1])  # the switch at recipe token 2560 falls inside phase B


@pytest.mark.slow
def test_a_resume_inside_the_batch_warmup_lands_on_the_same_curve(phase_a, tmp_path):
    # steps of 1, 1, 2, 2, 3, 3, 4 micro-batches (4 waits for a cycle of its length): micro-batch 10 is inside the
    # sixth step, after the checkpoint of step 4, which was written at an accumulation of 2
    run(tmp_path, *PHASE_A, *kill_at(10), killed=True)
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4
    run(tmp_path, *PHASE_A, "ckpt_path=last", *UNKILLED)
    assert steps(tmp_path) == steps(phase_a)
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(phase_a / "hf" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)
