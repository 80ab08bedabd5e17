"""`python run.py` end to end on CPU: training, metrics, plots, checkpoints, resume, HF export (on the byte
stream, experiment=tiny_bytes), and the default run: the embedded corpus prepared once (cached by
fingerprint), then the toy curriculum stage by stage."""

import csv
import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from glm46.data.chat import STOP_TOKENS
from glm46.data.tokenizer import GLMTokenizer
from glm46.hf import load_hf
from glm46.reports.plots import plot_run

from . import forked

ROOT = Path(__file__).resolve().parents[1]
SHORT_RUN = [
    "experiment=tiny_bytes",
    "data.max_bytes=300000",
    "data.seq_len=64",
    "data.batch_size=4",
    "trainer.val_check_interval=10",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=2",
    "callbacks.model_checkpoint.every_n_train_steps=10",
]


def run(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return forked.run(
        [sys.executable, "run.py", *SHORT_RUN, f"hydra.run.dir={run_dir}", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def column(rows: list[dict], name: str) -> list[float]:
    return [float(r[name]) for r in rows if r.get(name)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    result = run(run_dir, "trainer.max_steps=30")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_training_run_learns_and_logs_the_design_metrics(trained):
    rows = metrics(trained)
    for name in (
        "train/loss",
        "train/mtp_loss",
        "optim/lr",
        "moe/maxvio",
        "perf/tokens_per_sec",
        "perf/mfu",
        "optim/grad_norm",
        "moe/maxvio_layer0",
        "val/loss",
        "val/ppl",
    ):
        assert column(rows, name), f"metrics.csv has no {name}"
    loss = column(rows, "train/loss")
    assert loss[-1] < loss[0] - 1.0, f"loss did not fall: {loss}"
    assert column(rows, "val/loss")[-1] < column(rows, "val/loss")[0]
    lr = column(rows, "optim/lr")
    assert max(lr) <= 3e-3 + 1e-9 and lr[-1] < max(lr), "warm-up then cosine decay"
    for picture in ("loss.png", "expert_load.png"):
        assert (trained / picture).stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.distributed
def test_a_pipelined_run_validates_and_logs_every_stages_expert_load(trained, tmp_path):
    """parallelism=pp on 2 processes through run.py: validation runs through the schedule (val/loss logged), and
    expert_load.npz records the whole model's MoE layers, each stage's counted where it runs: the same layers and,
    step for step, the same number of routed tokens as the one-process run."""
    from .helpers import launcher_env

    result = forked.run_ranks(  # 2 ranks started as torchrun starts them
        [sys.executable, "run.py", *SHORT_RUN, f"hydra.run.dir={tmp_path}", "trainer.max_steps=20"]
        + ["parallelism=pp", "cluster.devices=2"],
        2,
        cwd=ROOT,
        env=launcher_env(),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(tmp_path)
    assert len(column(rows, "val/loss")) == 2 and column(rows, "train/loss")[-1] < column(rows, "train/loss")[0]
    pipelined, single = (np.load(run / "expert_load.npz") for run in (tmp_path, trained))
    assert pipelined["counts"].shape[1:] == single["counts"].shape[1:]  # [records, MoE layers, experts]
    routed = pipelined["counts"].sum(axis=2)  # per record and layer: every token's top-k choices
    assert (routed == single["counts"].sum(axis=2)[: len(routed)]).all()


@pytest.mark.slow
def test_hf_export_loads_in_transformers_with_the_checkpoint_logits(trained):
    checkpoint = torch.load(trained / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 30 and checkpoint["tokens_seen"] == 30 * 4 * 64
    exported = load_hf(trained / "hf")
    state = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    hf = AutoModelForCausalLM.from_pretrained(trained / "hf").eval()
    x = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, exported.eval()(x).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_resume_from_last_continues_steps_schedules_and_metrics(tmp_path):
    assert run(tmp_path, "trainer.max_steps=20").returncode == 0
    result = run(tmp_path, "trainer.max_steps=30", "ckpt_path=last")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Restored all states from the checkpoint" in result.stdout + result.stderr
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 30 and checkpoint["tokens_seen"] == 30 * 4 * 64
    steps = sorted(p.name for p in (tmp_path / "checkpoints").glob("step*.ckpt"))
    assert steps == ["step0000010.ckpt", "step0000020.ckpt", "step0000030.ckpt"]
    logged_steps = sorted({int(r["step"]) for r in metrics(tmp_path) if r.get("train/loss")})
    assert logged_steps[0] < 10 and logged_steps[-1] >= 28, "metrics.csv keeps the first run's rows and appends"


@pytest.mark.slow
def test_resume_in_a_copied_run_directory_overwrites_last_ckpt(trained, tmp_path):
    import shutil

    run_dir = tmp_path / "copied"
    shutil.copytree(trained, run_dir)
    assert run(run_dir, "trainer.max_steps=35", "ckpt_path=last").returncode == 0
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 35
    assert not list((run_dir / "checkpoints").glob("last-v*.ckpt"))


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    result = run(tmp_path, "trainer.max_steps=1", "model.vocab_size=200")
    assert result.returncode != 0
    assert "257 tokens but model.vocab_size=200" in result.stderr


@pytest.mark.slow
def test_tensorboard_and_offline_wandb_loggers_record_the_run(tmp_path):
    result = run(tmp_path, "trainer.max_steps=4", "logger=[csv,tensorboard,wandb]", "trainer.val_check_interval=4")
    assert result.returncode == 0, result.stderr[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert "train/loss" in events.Tags()["scalars"]
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")), "wandb must have written an offline run"
    # the composition reaches every logger as hyperparameters: wandb's config, TensorBoard's and CSV's hparams.yaml
    assert "hidden_size" in (tmp_path / "tensorboard" / "hparams.yaml").read_text()
    records = next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()  # config records, offline
    assert b"hidden_size" in records and b"max_steps" in records
    hparams = yaml.safe_load((tmp_path / "hparams.yaml").read_text())
    assert hparams["model"]["hidden_size"] == 128 and hparams["trainer"]["max_steps"] == 4


@pytest.mark.slow
def test_train_on_a_prepared_dataset(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    words = [f"{a}{b}{c}" for a in "bcdfg" for b in "aeiou" for c in "lmnrst"]
    (corpus / "docs.jsonl").write_text(
        "".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(80)) + "."}) + "\n" for _ in range(200))
    )
    dataset = tmp_path / "dataset"
    prepared = forked.run(
        [
            sys.executable,
            "run.py",
            "task=prepare",
            "source=jsonl",
            f"source.paths=[{corpus}]",
            f"source.output_dir={dataset}",
            "prepare.tokenizer.vocab_size=400",
            f"hydra.run.dir={tmp_path / 'prep'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    result = forked.run(
        [
            sys.executable,
            "run.py",
            "experiment=tiny_bytes",
            "data=shards",
            f"data.path={dataset}",
            "data.mixture={general: 1.0}",
            "data.seq_len=64",
            "data.batch_size=4",
            "model.vocab_size=400",
            "trainer.max_steps=12",
            "trainer.val_check_interval=6",
            "trainer.log_every_n_steps=2",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["ShardDataModule"]["samples"] == 12 * 4
    loss = column(metrics(tmp_path / "run"), "train/loss")
    assert loss[-1] < loss[0]


@pytest.mark.slow
def test_init_from_a_checkpoint_or_an_hf_directory_loads_the_weights(trained):
    from glm46.checkpoint.weights import load_weights
    from glm46.modules import GLM46ForCausalLM

    exported = load_hf(trained / "hf")
    for source in (trained / "checkpoints" / "last.ckpt", trained / "hf"):
        model = GLM46ForCausalLM(exported.config)
        load_weights(model, source)
        for name, tensor in exported.state_dict().items():
            assert torch.equal(model.state_dict()[name], tensor), (source, name)


def write_word_corpus(path: Path, documents: int, seed: int) -> Path:
    """JSONL of documents of 60 random made-up words: varied enough for dedup and the quality rules."""
    rng = random.Random(seed)
    words = [f"{a}{b}{c}" for a in "bcdfg" for b in "aeiou" for c in "lmnrst"]
    path.write_text(
        "".join(
            json.dumps({"text": " ".join(rng.choice(words) for _ in range(60)) + "."}) + "\n" for _ in range(documents)
        )
    )
    return path


def fake_prepare(calls):
    """A stand-in for task=prepare that records its settings and writes shards with a new fingerprint."""

    def prepare(source, settings):
        calls.append(source)
        tokens = Path(source.output_dir) / "tokens"
        tokens.mkdir(parents=True, exist_ok=True)
        (tokens / "shards.json").write_text(json.dumps({"fingerprint": f"build-{len(calls)}"}))

    return prepare


def test_the_default_run_prepares_once_and_again_when_its_fingerprint_changes(compose_config, tmp_path):
    from glm46.app.preparation import prepare_once

    corpus, dataset = write_word_corpus(tmp_path / "corpus.jsonl", 100, seed=0), tmp_path / "dataset"

    def config(*overrides):
        return compose_config(
            "source=jsonl",
            f"source.paths=[{corpus}]",
            f"source.output_dir={dataset}",
            "prepare.tokenizer.vocab_size=400",
            *overrides,
        )

    prepare_once(config())  # the real preparation, first use
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert manifest["documents_in"] == 100 and (dataset / "tokens" / "shards.json").is_file()
    calls = []
    prepare_once(config(), fake_prepare(calls))
    prepare_once(config("prepare.num_workers=1"), fake_prepare(calls))  # does not change the output
    assert calls == [], "a second run reuses the prepared dataset"

    prepare_once(config("prepare.dedup.threshold=0.7"), fake_prepare(calls))
    assert len(calls) == 1 and calls[0].reader == "jsonl" and calls[0].output_dir == str(dataset)
    prepare_once(config("prepare.dedup.threshold=0.7"), fake_prepare(calls))
    assert len(calls) == 1, "the rebuilt dataset is cached under its new fingerprint"

    with open(corpus, "a") as f:  # a changed source
        f.write(json.dumps({"text": "one more document, long enough to be kept by the quality rules."}) + "\n")
    prepare_once(config("prepare.dedup.threshold=0.7"), fake_prepare(calls))
    assert len(calls) == 2

    (dataset / "tokens" / "shards.json").write_text(json.dumps({"fingerprint": "another task=prepare"}))
    prepare_once(config("prepare.dedup.threshold=0.7"), fake_prepare(calls))
    assert len(calls) == 3, "shards rewritten by another preparation are not taken for this one's"


def test_task_prepare_on_the_default_run_builds_its_corpus_once(compose_config, tmp_path):
    from glm46.app.tasks import run_task

    corpus, dataset = write_word_corpus(tmp_path / "corpus.jsonl", 50, seed=1), tmp_path / "dataset"
    config = compose_config(
        "task=prepare",
        "source=jsonl",
        f"source.paths=[{corpus}]",
        f"source.output_dir={dataset}",
        "prepare.tokenizer.vocab_size=300",
    )
    run_task(config)
    assert json.loads((dataset / "manifest.json").read_text())["documents_in"] == 50
    fingerprint = json.loads((dataset / "tokens" / "shards.json").read_text())["fingerprint"]
    run_task(config)  # prepared: nothing rebuilt
    assert json.loads((dataset / "tokens" / "shards.json").read_text())["fingerprint"] == fingerprint


def test_a_run_on_other_data_prepares_nothing_and_leaves_that_data_alone(compose_config, tmp_path):
    from glm46.app.preparation import prepare_once

    calls = []
    prepare_once(compose_config("experiment=tiny_bytes"), fake_prepare(calls))
    prepare_once(compose_config("data=stdlib"), fake_prepare(calls))  # the default run's stages on the byte stream
    # the default experiment on a dataset of one's own: neither the embedded corpus nor that folder is written
    prepare_once(
        compose_config("data=shards", f"data.path={tmp_path}", f"source.output_dir={tmp_path / 'x'}"),
        fake_prepare(calls),
    )
    prepare_once(compose_config(f"data.path={tmp_path}"), fake_prepare(calls))
    assert calls == [] and list(tmp_path.iterdir()) == []
    assert compose_config(f"source.output_dir={tmp_path}").data.path == str(tmp_path)


@pytest.mark.slow
def test_default_run_prepares_the_embedded_corpus_and_trains_through_the_curriculum(tmp_path):
    dataset, run_dir = tmp_path / "embedded", tmp_path / "run"
    small = [
        f"source.output_dir={dataset}",
        "source.options.math_problems=2000",
        "source.options.reasoning_problems=1000",
        "source.options.sft_conversations=1000",
        "source.options.rl_prompts=200",
        "source.options.tool_prompts=200",
        "source.options.copy_drills=200",
        "prepare.tokenizer.vocab_size=4096",  # a tool prompt fits RL's 224 tokens (about 250 in 2,048 tokens)
        "data.batch_size=4",
        "phase.seq_len=128",
        "trainer.log_every_n_steps=1",
        "trainer.limit_val_batches=2",
        "eval.limit=20",
        "eval.ppl_documents=4",
        f"hydra.run.dir={run_dir}",
    ]
    first = forked.run(
        [sys.executable, "run.py", *small, "trainer.max_steps=4"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert f"dataset: preparing {dataset}" in first.stdout
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert manifest["documents_in"] == manifest["documents_out"] + sum(manifest["dropped"].values())
    assert {"code", "repo_code", "docs", "license", "math", "reasoning", "sft", "rl", "tool"} <= set(
        manifest["domains"]
    )

    stages = {"copy": "toy_copy", "pretrain1": "toy_pretrain1", "pretrain2": "toy_pretrain2"}
    stages |= {"midtrain": "toy_midtrain", "sft": "toy_sft"}
    first_losses, previous = [], None
    for name, phase in stages.items():
        stage_dir = run_dir / "stages" / name
        checkpoint = torch.load(stage_dir / "checkpoints" / "last.ckpt", weights_only=False)
        data_state = checkpoint["SFTDataModule" if name == "sft" else "ShardDataModule"]
        assert checkpoint["global_step"] == 4 and data_state["phase"] == phase
        assert (stage_dir / "hf" / "config.json").is_file() and (stage_dir / ".hydra" / "config.yaml").is_file()
        assert f"phase={phase}" in (stage_dir / ".hydra" / "overrides.yaml").read_text()
        stage_config = yaml.safe_load((stage_dir / ".hydra" / "config.yaml").read_text())
        assert stage_config["init_from"] == previous and stage_config["phase"]["name"] == phase
        previous = str(stage_dir / "hf")  # each stage starts from the previous one's final weights
        first_losses.append(column(metrics(stage_dir), "train/loss")[0])
    # the LR: one warm-up (from 0) at the start of the recipe's clock, in the copy drill; the pre-training phases and
    # mid-training further down its cosine at their places on it (not restarted from 0); SFT warming up again on a
    # clock of its own
    first_lr = {name: column(metrics(run_dir / "stages" / name), "optim/lr")[0] for name in stages}
    assert first_lr["copy"] == 0.0 and first_lr["sft"] == 0.0
    assert 0.0 < first_lr["midtrain"] < first_lr["pretrain2"] < first_lr["pretrain1"] < 3e-3
    chain = json.loads((run_dir / "curriculum.json").read_text())
    assert [entry["init_from"] for entry in chain] == [None] + [str(run_dir / "stages" / n / "hf") for n in stages]
    assert all(loss < first_losses[0] for loss in first_losses[1:]), f"each stage starts from the last: {first_losses}"
    # the run directory is the last stage's (GRPO), as any run directory
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 4 and checkpoint["PromptDataModule"]["phase"] == "toy_rl"
    assert checkpoint["rl"]["prompts_seen"] == 8  # 4 updates: 2 rollouts of 4 prompts, 2 updates each (toy_rl)
    rewards = column(metrics(run_dir), "rl/reward_mean")
    assert (run_dir / "hf" / "config.json").is_file() and rewards and all(0 <= r <= 1 for r in rewards)
    # the final export serves as it is: the dataset's tokenizer (and chat template) beside the weights, GLM's stops
    assert (run_dir / "hf" / "tokenizer.json").read_bytes() == (dataset / "tokenizer.json").read_bytes()
    assert "chat_template" in json.loads((run_dir / "hf" / "tokenizer_config.json").read_text())
    tokenizer = GLMTokenizer.from_file(dataset / "tokenizer.json")
    stops = [tokenizer.token_id(token) for token in STOP_TOKENS]
    assert json.loads((run_dir / "hf" / "generation_config.json").read_text())["eos_token_id"] == stops
    # every stage but the drill is evaluated by lm-eval; the run ends with the table of skills and curriculum.png
    assert not (run_dir / "stages" / "copy" / "eval").exists()
    for stage_dir in [*(run_dir / "stages" / name for name in stages if name != "copy"), run_dir]:
        results = json.loads((stage_dir / "eval" / "results.json").read_text())
        assert {"glm46_arithmetic", "glm46_tool_arithmetic", "glm46_ppl_code"} <= set(results["results"])
        assert column(metrics(stage_dir), "eval/glm46_tool_arithmetic/tool_calls")
    printed = first.stdout + first.stderr
    assert "skills per stage" in printed and (run_dir / "curriculum.png").is_file()
    (run_dir / "curriculum.png").unlink()  # `python -m glm46.reports.plots RUN_DIR` redraws every plot of the run
    redrawn = plot_run(run_dir, curriculum=True)
    assert run_dir / "curriculum.png" in redrawn and run_dir / "loss.png" in redrawn
    for skill in ("arithmetic", "tool_arithmetic", "tool_calls"):  # each skill's paired change from stage to stage
        assert re.search(rf"{skill} sft -> toy_rl: [+-]\d\.\d{{3}} \(paired 95% CI \[[+-]\d\.\d{{3}}, ", printed)

    again = forked.run(
        [sys.executable, "run.py", *small, "trainer.max_steps=6", "ckpt_path=last"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"dataset: {dataset} (prepared" in again.stdout and "preparing" not in again.stdout
    assert again.stdout.count("finished before, skipped") == 5
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6


def test_the_skill_table_reports_accuracy_with_its_wilson_interval():
    from glm46.app.curriculum import skill_table
    from glm46.intervals import interval

    low, high = interval(0.5, 100)  # the Wilson score interval, as statsmodels' proportion_confint(method="wilson")
    assert (round(low, 4), round(high, 4)) == (0.4038, 0.5962)
    low, high = interval(0.0, 50)  # never below 0, and not empty at 0 successes
    assert low == pytest.approx(0.0, abs=1e-12) and round(high, 4) == 0.0714
    table = skill_table(
        {
            "pretrain1": {
                "glm46_arithmetic/exact_match": 0.0,
                "glm46_arithmetic/n": 50,
                "glm46_ppl_code/bits_per_byte": 2.5,
            },
            "rl": {"glm46_arithmetic/exact_match": 0.5, "glm46_arithmetic/n": 100, "glm46_arithmetic_mc/acc": 0.3},
        }
    )
    lines = table.splitlines()
    header = ["stage", "arithmetic (95% CI)", "arith. MC acc", "code bpb"]  # the skills some stage measured
    assert [c.strip() for c in lines[0].split(" | ")] == header
    assert "0.500 [0.404, 0.596] n=100" in lines[3] and "0.300" in lines[3] and lines[3].rstrip().endswith("-")
    assert "0.000 [0.000, 0.071] n=50" in lines[2] and "2.500" in lines[2]


def test_a_stage_to_stage_change_is_judged_on_the_same_prompts():
    from glm46.intervals import paired_change

    before = {i: float(i < 20) for i in range(100)}  # 20 right
    after = {i: float(i < 20 or 50 <= i < 60) for i in range(100)}  # the same 20, and 10 more
    change, low, high = paired_change(before, after)
    assert change == pytest.approx(0.10) and low > 0.0  # 10 gains, no loss: a real improvement
    assert (low, high) == pytest.approx((0.10 - 1.96 * math.sqrt(10 - 1) / 100, 0.10 + 1.96 * math.sqrt(10 - 1) / 100))
    swapped = {i: float(10 <= i < 30) for i in range(100)}  # 10 lost, 10 gained: no change, symmetric interval
    change, low, high = paired_change(before, swapped)
    assert change == 0.0 and low == pytest.approx(-high) and low < 0


def test_stages_branch_from_the_stage_they_name_and_are_compared_with_it(tmp_path):
    from glm46.app.curriculum import compared_stages
    from glm46.app.stage_graph import resolved

    overrides = ["init_from=@sft", "phase.reward.model=@reward_model", "data=embedded_rl"]
    assert resolved(overrides, tmp_path, {}) == [
        f"init_from={tmp_path}/stages/sft/hf",
        f"phase.reward.model={tmp_path}/stages/reward_model/hf",
        "data=embedded_rl",
    ]
    stage = {name: tmp_path / "stages" / name for name in ("copy", "pretrain", "sft", "reward_model", "rlhf")}
    stages = [
        ("copy", stage["copy"], None),
        ("pretrain", stage["pretrain"], str(stage["copy"] / "hf")),  # from a stage that was not evaluated
        ("sft", stage["sft"], str(stage["pretrain"] / "hf")),
        ("reward_model", stage["reward_model"], str(stage["sft"] / "hf")),
        ("rlhf", stage["rlhf"], str(stage["sft"] / "hf")),
        ("dpo", tmp_path, str(stage["sft"] / "hf")),
    ]
    evaluated = {"pretrain", "sft", "rlhf", "dpo"}
    assert compared_stages(stages, evaluated) == [("pretrain", "sft"), ("sft", "rlhf"), ("sft", "dpo")]


def test_a_unified_stage_is_compared_with_its_experts_and_their_cold_start(tmp_path):
    from glm46.app.curriculum import taught_pairs

    where = {name: tmp_path / name for name in ("mid", "cold", "expert_a", "expert_b", "unified")}
    stages = [
        ("mid", where["mid"], None),
        ("cold", where["cold"], str(where["mid"] / "hf")),
        ("expert_a", where["expert_a"], str(where["cold"] / "hf")),
        ("expert_b", where["expert_b"], str(where["cold"] / "hf")),
        ("unified", where["unified"], str(where["mid"] / "hf")),
    ]
    taught = {"unified": ["expert_a", "expert_b"]}
    evaluated = {"cold", "expert_a", "expert_b", "unified", "mid"}
    pairs = [("expert_a", "unified"), ("expert_b", "unified"), ("cold", "unified")]  # not mid: unified starts there
    assert taught_pairs(stages, taught, evaluated) == pairs
    assert taught_pairs(stages, taught, evaluated - {"expert_b"}) == [("expert_a", "unified"), ("cold", "unified")]
