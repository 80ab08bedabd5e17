"""A reward model and DPO from the command line: `module=reward_model` and `module=dpo` train on prepared pairs with
the README's commands, the reward model's export scores conversations as transformers reads its backbone, and
`task=score` prints its pairwise accuracy with the interval; what cannot run is refused naming the key."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import Glm4MoeForCausalLM

from glm46.config.checks import validate
from glm46.config.values import model_config
from glm46.data.pipeline import prepare_dataset
from glm46.data.preference_task import write_task
from glm46.data.tokenizer import GLMTokenizer
from glm46.errors import ConfigError
from glm46.hf import save_hf
from glm46.rl.reward_export import load_reward_model

from .helpers import random_model, run_py
from .test_parallel import compose_layout

VOCAB = 400
RUN = ["model=tiny", f"model.vocab_size={VOCAB}", "phase.seq_len=96", "data.batch_size=4", "trainer.max_steps=6"]


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> dict:
    """Prepared pairs of the style task and a random export of the tiny model in their tokenizer (the 'SFT')."""
    root = tmp_path_factory.mktemp("reward-model")
    pairs, _ = write_task(root, pairs=120, prompts=0)
    prepare_dataset("preference", [str(pairs)], root / "data", default_domain="preference", vocab_size=VOCAB)
    tokenizer = GLMTokenizer.from_file(root / "data" / "tokenizer.json")
    config = model_config(compose_layout("single", ["experiment=reward_model", *RUN]))  # the run's model
    weights = save_hf(random_model(config, seed=0), root / "sft", tokenizer=tokenizer)
    return {"root": root, "data": root / "data", "init_from": weights}


@pytest.fixture(scope="module")
def reward_run(setting):
    run_dir = setting["root"] / "rm"
    data, init = setting["data"], setting["init_from"]
    run_py("module=reward_model", "data=preference", f"data.path={data}", f"init_from={init}", *RUN,
           f"hydra.run.dir={run_dir}")  # fmt: skip
    return run_dir


@pytest.mark.slow
def test_reward_model_trains_exports_and_scores(setting, reward_run):
    metrics = (reward_run / "metrics.csv").read_text().splitlines()
    assert "rm/accuracy" in metrics[0] and "rm/margin" in metrics[0]
    info = json.loads((reward_run / "hf" / "reward_model.json").read_text())
    assert info["reward_std"] > 0 and load_file(reward_run / "hf" / "reward_head.safetensors")["score.weight"].any()
    score_dir = setting["root"] / "score"
    out = run_py(
        "task=score", f"score.model={reward_run}", f"score.data={setting['data']}", f"hydra.run.dir={score_dir}"
    )
    line = re.search(r"pairwise_accuracy: (\d\.\d{3}) \(95% CI \[(\d\.\d{3}), (\d\.\d{3})\]\) n=(\d+)", out.stdout)
    result = json.loads((score_dir / "score.json").read_text())
    assert line and int(line[4]) == result["n"] == len(result["correct"]) == 12  # the last 10% of 120 pairs
    assert float(line[1]) == pytest.approx(sum(result["correct"]) / 12, abs=5e-4)
    assert float(line[2]) <= float(line[1]) <= float(line[3])


@pytest.mark.slow
def test_the_export_scores_what_transformers_computes_from_it(setting, reward_run):
    """Our score of a conversation = the head times transformers' final hidden state at its last token."""
    model = load_reward_model(reward_run)
    ids = torch.randint(3, VOCAB, (3, 20), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([20, 13, 7])
    ours = model.score(ids, lengths)
    hf = Glm4MoeForCausalLM.from_pretrained(reward_run / "hf").eval()
    for row, length in enumerate(lengths):
        with torch.no_grad():
            hidden = hf(ids[row : row + 1, :length], output_hidden_states=True).hidden_states[-1][0, -1]
        assert ours[row].item() == pytest.approx((hidden @ model.head[0]).item(), rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_dpo_trains_from_the_command_line(setting):
    run_dir = setting["root"] / "dpo"
    data, init = setting["data"], setting["init_from"]
    run_py("module=dpo", "data=preference", f"data.path={data}", f"init_from={init}", *RUN, f"hydra.run.dir={run_dir}")
    header = (run_dir / "metrics.csv").read_text().splitlines()[0]
    for name in ("rewards/accuracies", "rewards/margins", "val/rewards/accuracies", "val/loss"):
        assert name in header
    assert (run_dir / "hf" / "config.json").is_file() and not (run_dir / "hf" / "reward_model.json").exists()


def test_what_cannot_run_is_refused_naming_the_key(compose_config, setting, tmp_path):
    data, init = setting["data"], setting["init_from"]
    with pytest.raises(ConfigError, match="preference pairs \\(data=preference\\) are trained by module=reward_model"):
        validate(compose_config("experiment=reward_model", "data=stdlib", f"init_from={init}", *RUN))
    with pytest.raises(ConfigError, match="parallelism=pp .*data-parallel layouts"):
        validate(compose_config("experiment=dpo", f"data.path={data}", f"init_from={init}", "parallelism=pp",
                                "cluster.devices=2", *RUN))  # fmt: skip
    with pytest.raises(ConfigError, match="score.model=.*holds no reward model"):
        validate(compose_config("task=score", f"score.model={init}", f"score.data={data}"))
    other = tmp_path / "other"  # pairs prepared with another tokenizer
    prepare_dataset("preference", [str(setting["root"] / "pairs.jsonl")], other, default_domain="preference",
                    vocab_size=VOCAB + 50)  # fmt: skip
    fake_rm = tmp_path / "rm"
    fake_rm.mkdir()
    for file in init.iterdir():
        (fake_rm / file.name).write_bytes(file.read_bytes())
    (fake_rm / "reward_model.json").write_text("{}")
    with pytest.raises(ConfigError, match=f"score.model and score.data have different tokenizers \\({fake_rm}"):
        validate(compose_config("task=score", f"score.model={fake_rm}", f"score.data={other}"))
