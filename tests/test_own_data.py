"""Your own data through the README's commands: naming a data group trains one stage of its kind (no curriculum), the
vocabulary follows the prepared dataset, data and weights of different tokenizers or shapes are refused at
composition naming both, and a run resumes (or is evaluated) from its directory alone."""

import csv
import json

import pytest
from omegaconf import OmegaConf

from glm46.config.aliases import renamed_overrides
from glm46.config.checks import validate
from glm46.config.restore import restored_overrides
from glm46.config.values import model_config
from glm46.data.pipeline import prepare_dataset
from glm46.data.preference_task import write_task
from glm46.errors import ConfigError

from .helpers import run_py
from .test_sft import make_chat_dataset

QUICK = [  # a few steps of each stage, every one logged and checkpointed
    "data.batch_size=2",
    "trainer.log_every_n_steps=1",
    "trainer.limit_val_batches=0",
    "callbacks.progress_bar=null",
    "callbacks.throughput=null",
    "callbacks.model_checkpoint.every_n_train_steps=2",
]


def command(*overrides: str) -> list[str]:
    """What run.py composes from these command-line overrides (glm46.config.restore, then glm46.config.aliases)."""
    return renamed_overrides(restored_overrides(list(overrides)))


@pytest.fixture(scope="module")
def runs(chat_dataset, tmp_path_factory) -> dict:
    """Pre-training, then SFT from its export, on chat_dataset (a 512-token tokenizer), each by its own command."""
    root = tmp_path_factory.mktemp("own")
    data = f"data.path={chat_dataset}"
    run_py("data=shards", data, "trainer.max_steps=2", *QUICK, f"hydra.run.dir={root / 'pretrain'}")
    run_py("data=sft", data, f"init_from={root / 'pretrain'}", "trainer.max_steps=2", *QUICK,
           f"hydra.run.dir={root / 'sft'}")  # fmt: skip
    return {"root": root, "pretrain": root / "pretrain", "sft": root / "sft"}


def logged_steps(run_dir) -> list[int]:
    with open(run_dir / "metrics.csv") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row["step"]]


def stages_of(run_dir) -> list[str]:
    overrides = OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")
    return [str(o) for o in overrides if str(o).startswith("experiment=")]


@pytest.mark.slow
def test_each_data_group_trains_one_stage_with_the_data_vocabulary(runs, chat_dataset):
    for name, experiment in (("pretrain", "own_pretrain"), ("sft", "own_sft")):
        run_dir = runs[name]
        assert stages_of(run_dir) == [f"experiment={experiment}"]
        assert not (run_dir / "curriculum.json").exists() and not (run_dir / "stages").exists()  # one stage
        assert json.loads((run_dir / "hf" / "config.json").read_text())["vocab_size"] == 512  # the data's tokenizer
        assert (run_dir / "hf" / "tokenizer.json").read_text() == (chat_dataset / "tokenizer.json").read_text()
        assert logged_steps(run_dir) == [0, 1]  # trainer.max_steps=2
    config = OmegaConf.load(runs["sft"] / "hparams.yaml")  # the composition, resolved, as run
    assert config.module._target_ == "glm46.lit.GLM46LitModule" and config.data.packing == "best_fit"
    assert dict(config.data.mixture) == pytest.approx({"rl": 7854 / 13823, "sft": 5969 / 13823}, abs=1e-6)


@pytest.mark.slow
def test_rl_and_a_reward_model_train_one_stage_from_the_sft_export(runs, chat_dataset):
    rl = runs["root"] / "rl"
    run_py("data=rl", f"data.path={chat_dataset}", f"init_from={runs['sft']}", "trainer.max_steps=1",
           "phase.grpo.samples_per_prompt=2", "phase.prompts_per_step=2", *QUICK, f"hydra.run.dir={rl}")  # fmt: skip
    assert stages_of(rl) == ["experiment=own_rl"] and (rl / "hf" / "config.json").is_file()
    pairs, _ = write_task(runs["root"] / "pairs", pairs=40, prompts=0)
    prepared = runs["root"] / "pairs-data"  # prepared with the SFT export's tokenizer, so they meet
    prepare_dataset("preference", [str(pairs)], prepared, default_domain="preference",
                    tokenizer_path=str(chat_dataset / "tokenizer.json"))  # fmt: skip
    rm = runs["root"] / "rm"
    run_py("data=preference", f"data.path={prepared}", f"init_from={runs['sft']}", "trainer.max_steps=2",
           "phase.seq_len=128", *QUICK, f"hydra.run.dir={rm}")  # fmt: skip
    assert stages_of(rm) == ["experiment=reward_model"] and (rm / "hf" / "reward_model.json").is_file()


@pytest.mark.slow
def test_a_run_resumes_from_its_directory_alone(runs):
    """`hydra.run.dir=R ckpt_path=last` recomposes R's own overrides (SFT on the data, from the pre-training export),
    not the default run's curriculum, and continues from R's last checkpoint."""
    result = run_py(f"hydra.run.dir={runs['sft']}", "ckpt_path=last", "trainer.max_steps=4")
    assert f"resuming {runs['sft']}: its overrides" in result.stderr and "experiment=own_sft" in result.stderr
    assert logged_steps(runs["sft"]) == [0, 1, 2, 3]  # two steps more, after the restored second one
    assert stages_of(runs["sft"]) == ["experiment=own_sft"]


def test_restored_overrides_put_the_saved_ones_underneath(tmp_path, capsys):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- experiment=own_sft\n- optim=muon\n- +phase.mixture.a=1\n")
    resumed = restored_overrides([f"hydra.run.dir={tmp_path}", "ckpt_path=last", "optim=adamw", "+phase.mixture.a=2"])
    assert resumed == ["experiment=own_sft", f"hydra.run.dir={tmp_path}", "ckpt_path=last", "optim=adamw",
                       "+phase.mixture.a=2"]  # fmt: skip
    assert "restored: experiment=own_sft optim=muon +phase.mixture.a=1" in capsys.readouterr().err
    assert restored_overrides([f"hydra.run.dir={tmp_path}", "trainer.max_steps=3"])[0] == f"hydra.run.dir={tmp_path}"
    evaluated = restored_overrides(["task=eval", f"eval.model={tmp_path}"])
    assert evaluated[:2] == ["experiment=own_sft", "optim=muon"] and evaluated[-2:] == [
        "task=eval",
        f"eval.model={tmp_path}",
    ]
    hf_dir = tmp_path / "hf"  # an HF directory: conf/eval's settings, not the default run's
    assert restored_overrides(["task=eval", f"eval.model={hf_dir}"])[0] == "experiment=evaluate"


def test_an_hf_directory_is_evaluated_with_conf_eval_settings(compose_config, tmp_path):
    cfg = compose_config(*command("task=eval", f"eval.model={tmp_path}"))
    default = compose_config("task=eval", f"eval.model={tmp_path}")
    assert (cfg.eval.limit, cfg.eval.max_gen_toks) == (None, 64)
    assert (default.eval.limit, default.eval.max_gen_toks) == (400, 32)  # what the default run's own evaluation uses
    assert cfg.eval.dataset == default.eval.dataset  # the default run's prepared corpus


def test_naming_a_data_group_selects_its_one_stage_experiment():
    assert command("data=shards", "data.path=D")[0] == "experiment=own_pretrain"
    assert command("data=sft", "data.path=D", "init_from=M")[0] == "experiment=own_sft"
    assert command("data=rl", "data.path=D", "init_from=M")[0] == "experiment=own_rl"
    assert command("data=preference", "data.path=D", "init_from=M")[0] == "experiment=reward_model"
    assert command("module=dpo", "data=preference", "data.path=D")[0] == "experiment=dpo"
    assert command("experiment=toy_stage", "data=shards", "data.path=D")[0] == "experiment=toy_stage"
    assert command("trainer.max_steps=5") == ["trainer.max_steps=5"]  # the default run: its curriculum


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """The same kind of data, prepared with a 431-token tokenizer of its own."""
    return make_chat_dataset(tmp_path_factory.mktemp("other"), conversations=30, prompts=40, vocab_size=431)


def test_the_vocabulary_follows_the_data_and_mismatches_are_refused(
    compose_config, runs, chat_dataset, other_tokenizer
):
    cfg = compose_config(*command("data=shards", f"data.path={other_tokenizer}"))
    assert model_config(cfg).vocab_size == 512  # 431 padded to a multiple of 128
    assert (
        model_config(
            compose_config(*command("data=shards", f"data.path={chat_dataset}", "model.vocab_size=640"))
        ).vocab_size
        == 640
    )
    with pytest.raises(
        ConfigError, match=r"its tokenizer \(.*tokenizer.json\) has 512 tokens, more than model.vocab_size=256"
    ):
        validate(compose_config(*command("data=shards", f"data.path={chat_dataset}", "model.vocab_size=256")))
    export = runs["pretrain"] / "hf"
    both = f"\\({export}/tokenizer.json and {other_tokenizer}/tokenizer.json\\)"
    for data in ("sft", "rl", "preference"):  # every module: data from another tokenizer than init_from's
        overrides = command(f"data={data}", f"data.path={other_tokenizer}", f"init_from={runs['pretrain']}")
        with pytest.raises(ConfigError, match=f"init_from and data.path have different tokenizers {both}"):
            validate(compose_config(*overrides))
    with pytest.raises(ConfigError, match="differs from the composed model .* in hidden_size: 128 there, 64 here"):
        validate(
            compose_config(
                *command("data=sft", f"data.path={chat_dataset}", f"init_from={export}", "model.hidden_size=64")
            )
        )
    with pytest.raises(ConfigError, match="phase.mixture: data.path=/nowhere holds no prepared dataset"):
        validate(compose_config(*command("data=shards", "data.path=/nowhere")))
