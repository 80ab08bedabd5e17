"""`python -m glm46.diff A B`: the key-by-key difference of two compositions (override lists or run dirs)."""

import sys
from pathlib import Path

import pytest
import yaml

from glm46.optim.schedules import LinearRamp, steps_for
from glm46.reports.config_diff import SpecError, compose_from, diff_configs, main

from . import forked

ROOT = Path(__file__).resolve().parents[1]
PHASE1 = "experiment=pretrain_phase1 cluster=h800_1024n"  # its step count reads the data-parallel ranks

# conf/optim/muon.yaml and adamw.yaml share lr, weight_decay, betas and eps; AdamW has no
# Muon-only settings; the targets differ.
ABLATION_KEYS = {
    "optim.optimizer._target_": {"a": "glm46.optim.Muon", "b": "torch.optim.AdamW"},
    "optim.optimizer.momentum": {"a": 0.95},
    "optim.optimizer.nesterov": {"a": True},
    "optim.optimizer.ns_steps": {"a": 5},
    "optim.optimizer.ns_dtype": {"a": "bfloat16"},
    "optim.optimizer.update_rms": {"a": 0.2},
    "optim.ns_batch_bytes": {"a": 1280 * 2**20},  # Newton-Schulz's batch, 1/64 of the H800's 80 GiB
    "optim.optimizer.ns_batch_bytes": {"a": 1280 * 2**20},
}


def run_main(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real Hydra run directory, written by `python run.py task=estimate` (no training)."""
    path = tmp_path_factory.mktemp("run") / "estimate"
    forked.run(
        [sys.executable, "run.py", "task=estimate", f"hydra.run.dir={path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    for name in ("config.yaml", "overrides.yaml", "hydra.yaml"):
        assert (path / ".hydra" / name).is_file()
    return path


def test_diff_configs_is_key_by_key():
    a = {"x": {"y": 1, "z": [1, 2], "gone": "v"}, "same": 1.0, "t": 1}
    b = {"x": {"y": 2, "z": [1, 2], "new": None}, "same": 1.0, "t": 1.0}
    assert diff_configs(a, b) == {
        "t": {"a": 1, "b": 1.0},  # an int is not a float: a type change is a change
        "x.gone": {"a": "v"},
        "x.new": {"b": None},
        "x.y": {"a": 1, "b": 2},
    }
    assert list(diff_configs(a, b)) == sorted(diff_configs(a, b))
    assert diff_configs(a, a) == {}


def test_the_ablation_changes_exactly_the_optimizer_keys():
    cfg_a, choices_a = compose_from(PHASE1)
    cfg_b, choices_b = compose_from(f"{PHASE1} optim=adamw")
    assert diff_configs(choices_a, choices_b) == {"optim": {"a": "muon", "b": "adamw"}}
    assert diff_configs(cfg_a, cfg_b) == ABLATION_KEYS
    # resolved: the step count comes from the `phase_steps` resolver (15T at 64M, plus the batch warm-up's smaller
    # steps: 16 micro-batches of 4M from 4), the lr schedule from the optimizer
    ramp = LinearRamp(start=16 * 2**20, end=64 * 2**20, ramp_tokens=500 * 10**9)
    assert cfg_a["trainer"]["max_steps"] == steps_for(15 * 10**12, ramp, 0, 4 * 2**20, 16) > 15 * 10**12 // 2**26
    assert cfg_a["schedule"]["lr"]["scale"] == 1.0 and cfg_a["optim"]["optimizer"]["lr"] == 2.5e-4
    assert cfg_a["data"]["path"] == "???"  # a missing value does not stop the diff
    assert "hydra" not in cfg_a


def test_the_command_prints_the_ablation(capsys):
    code, out, _ = run_main(capsys, PHASE1, f"{PHASE1} optim=adamw")
    assert code == 0
    lines = out.splitlines()
    assert "  optim: muon -> adamw" in lines
    assert "  optim.optimizer._target_: glm46.optim.Muon -> torch.optim.AdamW" in lines
    assert "  optim.optimizer.momentum: 0.95 -> (absent)" in lines
    changed = [
        line.split(":")[0].strip() for line in lines[lines.index(next(x for x in lines if x.startswith("keys"))) + 1 :]
    ]
    assert changed == sorted(ABLATION_KEYS)


def test_python_m_glm46_diff_runs_as_a_module():
    result = forked.run(
        [sys.executable, "-m", "glm46.diff", PHASE1, f"{PHASE1} optim=adamw", "--exit-code"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert "optim: muon -> adamw" in result.stdout and "Traceback" not in result.stderr


def test_identical_specs_give_no_difference(capsys):
    code, out, _ = run_main(capsys, "", "", "--exit-code")
    assert code == 0
    assert "defaults: no difference" in out and "keys: no difference" in out
    # the same composition spelt two ways
    code, out, _ = run_main(capsys, "optim=muon", "", "--exit-code")
    assert code == 0


def test_exit_code(capsys):
    assert run_main(capsys, "", "seed=1")[0] == 0  # like git diff: differences are not an error
    code, out, _ = run_main(capsys, "", "seed=1", "--exit-code")
    assert code == 1 and "  seed: 0 -> 1" in out.splitlines()  # the default seed is 0


def test_yaml_output(capsys):
    code, out, _ = run_main(capsys, PHASE1, f"{PHASE1} optim=adamw trainer.precision=32-true", "--yaml")
    assert code == 0
    doc = yaml.safe_load(out)
    assert set(doc) == {"defaults", "changed"}
    assert doc["defaults"] == {"optim": {"a": "muon", "b": "adamw"}}
    # FSDP2's policy follows trainer.precision: bf16 parameters with fp32 reductions under bf16-mixed, none at 32-true
    # (once, in parallelism.strategy: the trainer no longer copies the strategy node)
    policy = {"": {"b": None}, ".param_dtype": {"a": "bfloat16"}, ".reduce_dtype": {"a": "float32"}}
    assert doc["changed"] == {
        **ABLATION_KEYS,
        "trainer.precision": {"a": "bf16-mixed", "b": "32-true"},
        **{f"parallelism.strategy.mixed_precision{key}": change for key, change in policy.items()},
    }
    assert yaml.safe_load(run_main(capsys, "", "", "--yaml")[1]) == {"defaults": {}, "changed": {}}


def test_a_run_directory_against_override_lists(capsys, run_dir):
    cfg, choices = compose_from(str(run_dir))
    assert choices["model"] == "tiny_8k" and choices["optim"] == "muon"
    assert cfg["task"] == "estimate" and "hydra" not in cfg
    # its own overrides compose to the same config: no difference (the output dir is not compared)
    assert run_main(capsys, str(run_dir), "task=estimate", "--exit-code")[0] == 0
    _, out, _ = run_main(capsys, str(run_dir), "optim=adamw", "--yaml")
    doc = yaml.safe_load(out)
    assert doc["defaults"] == {"optim": {"a": "muon", "b": "adamw"}}
    assert doc["changed"]["task"] == {"a": "estimate", "b": "train"}
    assert doc["changed"]["optim.optimizer._target_"] == {"a": "glm46.optim.Muon", "b": "torch.optim.AdamW"}
    # the default experiment's lr is kept by both
    assert "optim.optimizer.lr" not in doc["changed"]


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim=adamx", "optim/adamx"),  # unknown group member
        ("trainer.max_stepz=3", "trainer.max_stepz"),  # misspelt key
        ("model.hidden_size=abc", "model.hidden_size"),  # wrong type
    ],
)
def test_a_bad_override_exits_2_naming_it(capsys, override, key):
    code, out, err = run_main(capsys, "", override)
    assert code == 2 and out == ""
    assert key in err and "Traceback" not in err


def test_a_missing_run_directory_exits_2(capsys, tmp_path):
    code, _, err = run_main(capsys, str(tmp_path / "nope"), "")
    assert code == 2 and "not a run directory" in err
    with pytest.raises(SpecError):
        compose_from(str(tmp_path))  # a directory without .hydra/


def test_an_unresolvable_interpolation_keeps_its_text():
    cfg, _ = compose_from("+extra=${no.such.key} +ok=${seed}")
    assert cfg["extra"] == "${no.such.key}" and cfg["ok"] == 0
    # ${hydra:...} names the run's output directory: kept as written on every side
    assert cfg["logger"]["csv"]["save_dir"] == "${hydra:runtime.output_dir}"


def test_config_dir_option(capsys, tmp_path):
    (tmp_path / "size").mkdir()
    (tmp_path / "config.yaml").write_text("defaults:\n  - size: small\n  - _self_\nname: x\n")
    (tmp_path / "size" / "small.yaml").write_text("width: 1\n")
    (tmp_path / "size" / "large.yaml").write_text("width: 2\ndepth: 3\n")
    code, out, _ = run_main(capsys, "", "size=large", "--config-dir", str(tmp_path), "--yaml")
    assert code == 0
    assert yaml.safe_load(out) == {
        "defaults": {"size": {"a": "small", "b": "large"}},
        "changed": {"size.depth": {"b": 3}, "size.width": {"a": 1, "b": 2}},
    }
