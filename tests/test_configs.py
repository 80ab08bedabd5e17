"""The Hydra tree: every config composes and validates; bad input fails at composition, naming the key."""

import os
import shutil
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from glm46.config.checks import model_config, validate
from glm46.errors import ConfigError
from glm46.hf import save_hf
from glm46.modules import GLM46Config, GLM46ForCausalLM
from glm46.planning.counts import count_parameters, format_counts

from . import forked
from .helpers import TINY, tiny_config

ROOT = Path(__file__).resolve().parents[1]
MODELS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))
GROUPS = ["model", "optim", "data", "parallelism", "cluster", "logger", "experiment"]


def test_every_group_has_members():
    for group in GROUPS:
        assert list((ROOT / "conf" / group).glob("*.yaml")), f"conf/{group}/ is empty"


BUILT = {  # group -> the `_target_` nodes of its members that build cheaply (the Trainer and DataModules do I/O)
    "schedule": lambda node: [node.lr, node.mtp_weight, node.balancer_rate],
    "callbacks": lambda node: list(node.values()),
    "logger": lambda node: list(node.values()),
    "guard": lambda node: [node],
    "prepare": lambda node: [node.quality],
    # parallelism: the strategies take the job's Layout; test_parallel_layout builds each with one
}
MEMBERS = [
    (group, path.stem)
    for group in (
        "module",
        "optim",
        "schedule",
        "recipe",
        "source",
        "data",
        "phase",
        "prepare",
        "trainer",
        "callbacks",
        "guard",
        "parallelism",
        "cluster",
        "logger",
        "paths",
    )
    for path in sorted((ROOT / "conf" / group).glob("*.yaml"))
]


@pytest.mark.parametrize("group, member", MEMBERS, ids=[f"{g}={m}" for g, m in MEMBERS])
def test_every_group_member_composes_and_its_objects_build(tmp_path, group, member):
    """As lightning-hydra-template does: every config file composes against its schema, and its objects build."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate
    from omegaconf import read_write

    from glm46.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"{group}={member}", f"hydra.run.dir={tmp_path}"], return_hydra_config=True)
    GlobalHydra.instance().clear()
    with read_write(cfg.hydra.runtime):
        cfg.hydra.runtime.output_dir = str(tmp_path)  # what a run sets: checkpoints and loggers write under it
    HydraConfig.instance().set_config(cfg)
    for node in BUILT.get(group, lambda node: [])(cfg[group]):
        assert instantiate(node) is not None


@pytest.mark.parametrize("model", MODELS)
def test_every_model_config_composes_and_validates(compose_config, model, tmp_path):
    start = []  # model=auto reads init_from's config.json (tests/test_peft_run.py refuses it without one)
    if model == "auto":
        start = [f"init_from={save_hf(GLM46ForCausalLM(tiny_config(vocab_size=512)), tmp_path / 'hf')}"]
    cfg = compose_config("experiment=tiny_bytes", f"model={model}", *start)
    validate(cfg)
    assert isinstance(model_config(cfg), GLM46Config)


FULL_SCALE = {"pretrain_phase1", "pretrain_phase2", "midtrain", "midtrain_long", "midtrain_200k", "sft", "rl"}
YOUR_DATA = {"reward_model", "dpo", "own_pretrain", "own_sft", "own_rl"}  # toy sizes on your prepared data
FINE_TUNING = {"glm45_air_lora", "glm45_355b_dora", "glm45_air_sft", "glm45_355b_sft"}  # on clusters of their own


def test_a_runs_peft_settings_reach_its_adapter_stage_alone():
    """experiment=toy_lora peft.r=32: the stages trained whole (peft=none) compose without the adapter's settings."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from glm46.app.curriculum import compose_stage
    from glm46.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    run = ["experiment=toy_lora", "peft.r=32"]
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=run)
            assert cfg.peft.r == 32
            assert compose_stage(list(cfg.stages.sft), run).peft is None
    finally:
        GlobalHydra.instance().clear()


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")))
def test_every_experiment_composes_and_validates(compose_config, experiment, chat_dataset):
    if experiment in YOUR_DATA:  # a prepared dataset: its vocabulary (and own_*: its domains) read at composition
        pairs = experiment in ("reward_model", "dpo")
        data = ["data.path=/data", "model.vocab_size=512"] if pairs else [f"data.path={chat_dataset}"]
        validate(compose_config(f"experiment={experiment}", *data, "init_from=/ckpt"))
        return
    if experiment in FINE_TUNING:
        validate(compose_config(f"experiment={experiment}", "data.path=/data", "init_from=/ckpt"))
        return
    if experiment not in FULL_SCALE:
        validate(compose_config(f"experiment={experiment}"))
        return
    cfg = compose_config(f"experiment={experiment}", "cluster=h800_1024n", "data.path=/data", "init_from=/ckpt")
    validate(cfg)


def test_128k_rows_on_the_pipelined_production_layout_are_refused_naming_the_layout_that_fits(compose_config):
    """16 stages keep up to 32 microbatch chunks of a 128K row: 109 GiB per GPU. The refusal says what fits."""
    cfg = compose_config(
        "experiment=midtrain", "phase=midtrain_long", "cluster=h800_1024n", "data.path=/data", "init_from=/ckpt"
    )
    with pytest.raises(
        ConfigError, match="does not fit: 109.2 GiB.*parallelism=long_context, experiment=midtrain_long"
    ):
        validate(cfg)


def test_glm46_and_glm45_differ_only_in_context(compose_config):
    glm46 = model_config(compose_config("model=glm46_355b"))
    glm45 = model_config(compose_config("model=glm45_355b"))
    assert glm46.max_position_embeddings == 202752 and glm45.max_position_embeddings == 131072
    glm45.max_position_embeddings = glm46.max_position_embeddings
    assert glm45 == glm46


def test_misspelt_model_key_fails_at_composition_naming_it(compose_config):
    with pytest.raises(ConfigCompositionException) as error:
        compose_config("model.hiden_size=64")
    assert "hiden_size" in str(error.value.__cause__ or error.value)


def test_wrong_type_fails_at_composition_naming_the_key(compose_config):
    with pytest.raises((ConfigCompositionException, ValidationError)) as error:
        compose_config("model.num_hidden_layers=many")
    assert "num_hidden_layers" in str(error.value) + str(error.value.__cause__)


def test_misspelt_key_in_a_model_yaml_fails(compose_config, tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    (conf / "model" / "typo.yaml").write_text("defaults:\n  - tiny\n\nn_routed_expert: 8\n")
    with pytest.raises(ConfigCompositionException) as error:
        compose_config("model=typo", config_dir=conf)
    assert "n_routed_expert" in str(error.value) + str(error.value.__cause__)


@pytest.mark.parametrize(
    "overrides, names",
    [
        ({"num_key_value_heads": 3}, ["num_attention_heads=4", "num_key_value_heads=3"]),
        ({"num_experts_per_tok": 9}, ["num_experts_per_tok=9", "n_routed_experts=8"]),
        ({"n_group": 3}, ["n_routed_experts=8", "n_group=3"]),
        ({"n_group": 2, "topk_group": 3}, ["topk_group=3", "n_group=2"]),
        ({"head_dim": 30, "partial_rotary_factor": 0.1}, ["rotary dim", "head_dim=30"]),
        ({"first_k_dense_replace": 5}, ["first_k_dense_replace=5", "num_hidden_layers=3"]),
        ({"hidden_size": 0}, ["hidden_size=0"]),
        ({"pad_token_id": 151329}, ["pad_token_id=151329", "vocab_size=160"]),
        ({"tie_word_embeddings": True}, ["tie_word_embeddings"]),
        ({"n_routed_experts": 8, "n_group": 8, "topk_group": 1}, ["n_group=8", "must be >= 2"]),
    ],
)
def test_inconsistent_model_shapes_are_rejected_with_keys_and_values(overrides, names):
    with pytest.raises(ConfigError) as error:
        GLM46Config(**{**TINY, **overrides})
    for name in names:
        assert name in str(error.value)


def test_inconsistent_composition_is_rejected_before_the_task(compose_config):
    cfg = compose_config("model=tiny", "model.num_key_value_heads=3")
    with pytest.raises(ConfigError, match="model: .*num_key_value_heads=3"):
        validate(cfg)
    with pytest.raises(ConfigCompositionException) as error:
        compose_config("task=nope")  # the schema's Task enum
    assert (
        "Invalid value 'nope', expected one of "
        "[train, prepare, estimate, plan, dryrun, eval, serve, export, score, sample]" in str(error.value.__cause__)
    )


def test_glm45_glm46_counts_match_the_reference():
    counts = count_parameters(GLM46Config(max_position_embeddings=202752))
    assert counts["total"] - counts["embedding"] - counts["lm_head"] == 355_233_991_936
    assert counts["total"] - counts["mtp"] == 352_797_814_784
    assert counts["active"] == 32_080_359_424
    assert counts["embedding"] == counts["lm_head"] == 775_946_240
    assert counts["mtp"] == 3_988_069_632


def test_air_counts_match_the_reference(compose_config):
    counts = count_parameters(model_config(compose_config("model=glm45_air_106b")))
    assert counts["active"] == 12_182_609_920
    assert counts["total"] - counts["mtp"] == 106_852_245_504
    assert counts["mtp"] == 2_375_059_456
    # the report's figures beside ours, by the report's definition (Table 1: MTP in, embedding and output layer out)
    assert (
        "the GLM-4.5 report (Table 1, MTP included, embedding and output layer not): 106B total, 12B active; "
        "ours by that definition: 107.99B total, 12.18B active" in format_counts("glm45_air_106b", counts)
    )


def test_run_py_estimate_prints_the_table(tmp_path):
    result = forked.run(
        [sys.executable, "run.py", "task=estimate", "model=glm46_355b", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "355,233,991,936" in result.stdout and "32,080,359,424" in result.stdout
    # 356.8B weights in bf16 (the router's correction bias in fp32); FP8: 1 byte a quantized weight + its scales
    assert (
        "export on disk (task=export): bf16 713.57 GB, block FP8 358.50 GB, GGUF f16 713.72 GB, q8_0 379.31 GB, "
        "q4_k_m 215.30 GB"
    ) in result.stdout


def test_run_py_refuses_a_misspelt_key_naming_it(tmp_path):
    result = forked.run(
        [sys.executable, "run.py", "model.num_experts_per_tokk=2", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "num_experts_per_tokk" in result.stderr


def test_run_directories_are_keyed_by_slurm_job_id(monkeypatch):
    from glm46.config.resolvers import job_id

    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    assert job_id() == "1234"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert job_id() == "77_3"
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name)
    assert job_id().endswith(f"_{os.getpid()}")


def test_the_tools_recipe_runs_the_copy_drill_first_on_the_clock(compose_config):
    """experiment=toy_recipe_tools: the drill is the first stage and the first phase of the clock (near the peak LR;
    a dictionary merged onto toy_recipe's would list it last), single digits, a corpus of its own
    (source=embedded_tools, whose digit rule goes with it); experiment=toy_recipe skips the stage (null). It is the
    default run."""
    default, tools = compose_config("experiment=toy_recipe"), compose_config("experiment=toy_recipe_tools")
    assert compose_config() == tools
    assert list(default.stages)[0] == "copy" and default.stages["copy"] is None
    assert list(tools.stages) == ["copy", "pretrain1", "pretrain2", "midtrain", "sft"] and tools.stages["copy"]
    copy_stage = compose_config("experiment=toy_recipe_tools", *tools.stages["copy"])
    assert list(copy_stage.recipe.phases)[0] == "toy_copy" and copy_stage.schedule.start_tokens == 0
    assert not copy_stage.eval.after_train and tools.eval.after_train  # the drill's skills are all 0
    assert tools.prepare.tokenizer.max_digits == 1 and default.prepare.tokenizer.max_digits == 3
    # the digit rule is the tools corpus's: a user's corpus prepared under this experiment keeps GLM's three digits
    own = compose_config("experiment=toy_recipe_tools", "task=prepare", "source=jsonl", "source.paths=[a.jsonl]",
                         "source.output_dir=out")  # fmt: skip
    assert own.prepare.tokenizer.max_digits == 3 and own.source.options is None
    assert tools.source.output_dir != default.source.output_dir and tools.source.options.copy_drills > 0


def test_the_tools_recipe_plays_calculator_episodes_in_rl_after_an_sft_that_leaves_room(compose_config):
    """experiment=toy_recipe_tools's last stage: GRPO on arithmetic and two-turn calculator episodes (whose prompts
    fit), each turn bounded; its SFT sees fewer tool chats than the default corpus's tenth, and pre-training text."""
    default, tools = compose_config("experiment=toy_recipe"), compose_config("experiment=toy_recipe_tools")
    assert dict(tools.phase.mixture) == {"rl": 0.5, "tool": 0.5} and dict(default.phase.mixture) == {"rl": 1.0}
    assert tools.phase.grpo.max_turns == 2 and default.phase.grpo.max_turns == 1
    assert tools.phase.grpo.max_turn_tokens <= tools.eval.max_gen_toks < tools.phase.grpo.max_new_tokens
    assert tools.data.seq_len == tools.phase.max_prompt_len > default.phase.max_prompt_len
    assert 0 < tools.source.options.sft_tool_share < default.source.options.sft_tool_share == 0.1
    sft = compose_config("experiment=toy_recipe_tools", *tools.stages["sft"])
    assert sft.phase.name == "toy_sft" and dict(sft.phase.mixture) == {"sft": 1.0}
    # pre-training text replayed beside the conversations, from the same corpus, so that SFT does not forget it
    assert sft.data.replay.path == sft.data.path == tools.source.output_dir
    assert set(sft.data.replay.mixture) == {"code", "docs", "math", "reasoning"}
    # a batch with more replayed text than the mean is no loss spike (conf/guard/mixed_loss.yaml)
    assert sft.guard.spike_factor == 10 and tools.guard.spike_factor == 3
