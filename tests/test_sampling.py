"""Rejection sampling (`task=sample`): GLM's filters on planted candidates, best-of-K, the chat JSONL that source=chat
reads back, two processes equal to one, and what cannot run refused naming the key."""

import json
import random
import sys

import pytest
import torch

from glm46.config.checks import validate
from glm46.data.chat import EOS, render_chat
from glm46.data.chat_formats import read_chat
from glm46.data.chat_parse import parse_chat
from glm46.data.documents import Ledger
from glm46.data.embedded import conversation, render, rl_prompt, tool_conversation
from glm46.data.tokenizer import GLMTokenizer
from glm46.errors import ConfigError
from glm46.hf import load_hf, save_hf
from glm46.rl.episodes import Episode
from glm46.rl.reward_export import RewardModel
from glm46.rl.rewards import verify
from glm46.sampling.draw import DrawSettings, candidate, draw
from glm46.sampling.filters import REASONS, FilterSettings, best, rejection_reason
from glm46.sampling.prompt_records import SamplePrompt, jsonl_prompts, read_prompts
from glm46.sampling.rejection import judged

from . import forked
from .helpers import ROOT, UNKILLED, kill_at, run_py, train_tiny
from .slurm import require_slurm
from .test_sft import make_chat_dataset

SAMPLE = ["sample.limit=12", "sample.n=4", "sample.batch_size=4", "sample.temperature=0.7", "sample.max_new_tokens=48",
          "sample.pass_rate=[0.25,1.0]"]  # fmt: skip


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> dict:
    """Arithmetic and calculator prompts, and the tiny model trained on the arithmetic ones for a few seconds: enough
    for some of its samples to be right, in GLM's format."""
    root = tmp_path_factory.mktemp("sampling")
    data = make_chat_dataset(root / "data", conversations=0, prompts=200, tool_prompts=40)
    tokenizer = GLMTokenizer.from_file(data / "tokenizer.json")
    model = save_hf(train_tiny(data, tokenizer, steps=60, domain="rl"), root / "model", tokenizer=tokenizer)
    return {"root": root, "data": data, "model": model, "tokenizer": tokenizer}


def test_parse_chat_reads_back_what_render_chat_writes():
    rng = random.Random(0)
    for number in range(300):
        messages = tool_conversation(rng) if number % 3 == 0 else conversation(rng)
        text = render(messages)
        assert render_chat(*parse_chat(text)) == text
        assert render_chat(*parse_chat(text + EOS)) == text
    for broken, where in [
        ("<|user|>\nhi<|assistant|>\nhello", "no <think></think> block"),
        ("<|user|>\nhi<|assistant|>\n<think></think>\n<tool_call>calculator\n<arg_value>1</arg_value>\n</tool_call>",
         "text that is no"),
        ("<|user|>\nhi<|assistant|>\n<think></think>\n<tool_call>f\n</tool_call>\nmore", "text after its tool calls"),
        ("<|user|>\nhi<|observation|>\n42", "text outside <tool_response>"),
        ("hello<|user|>\nhi", "text before the first role token"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=where):
            parse_chat(broken)


def planted(tokenizer, reply: str, answer: int | None = 4, ended: str = "answered", **fields):
    """A candidate whose episode wrote `reply` (then <|endoftext|> when it answered) to `What is 2 + 2?`."""
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = SamplePrompt(0, "p", "rl", tokenizer.encode(render_chat(messages, add_generation_prompt=True)),
                          messages, None, answer, [])  # fmt: skip
    tokens = tokenizer.encode(reply) + ([tokenizer.token_id(EOS)] if ended == "answered" else [])
    reward = verify({"answer": answer}, reply) if answer is not None and ended == "answered" else 0.0
    episode = Episode(prompt.ids, tokens, [1] * len(tokens), ended=ended, reward=reward)
    made = candidate(prompt, 0, episode, tokenizer)
    for key, value in fields.items():
        setattr(made, key, value)
    return made


def test_each_filter_drops_its_planted_candidate_and_nothing_else(setting):
    tokenizer, settings = setting["tokenizer"], FilterSettings(min_reward=-1.0)
    good = "\n<think></think>\n2 + 2 = 4.\nAnswer: 4"
    cases = [
        (planted(tokenizer, good), None),
        (planted(tokenizer, "\n<think></think>\nIt is four, I think.", answer=None), None),  # open: the RM judges
        (planted(tokenizer, good, score=0.5), None),
        (planted(tokenizer, "\n<think></think>\n2 + 2 = 4.\n2 + 2 = 4.\n2 + 2 = 4.\nAnswer: 4"), "repetitive"),
        (planted(tokenizer, "\n<think></think>\nso so so so so so so so so so so so so so\nAnswer: 4"), "repetitive"),
        (planted(tokenizer, "\n4"), "too_short"),
        (planted(tokenizer, "\n<think></think>\n2 + 2 = 4.\nAns", ended="out_of_tokens"), "truncated"),
        (planted(tokenizer, "\n<think></think>\n2 + 2 = 4.\n2 + 2 = 4.\n2 + 2 = 4.\n2 +", ended="out_of_tokens"),
         "repetitive"),  # the first reason in order names it
        (planted(tokenizer, "\n<think></think>\n<tool_call>calc</tool_call>", ended="unparsed_call"),
         "broken_tool_protocol"),
        (planted(tokenizer, good, tool_errors=1), "broken_tool_protocol"),
        (planted(tokenizer, "\n2 + 2 = 4.\nAnswer: 4"), "malformed"),  # no <think> block: not GLM's format
        (planted(tokenizer, "\n<think></think>\n2 + 2 = 4, so four."), "malformed"),  # no Answer line
        (planted(tokenizer, "\n<think></think>\n2 + 2 = 5.\nAnswer: 5"), "wrong_answer"),
        (planted(tokenizer, good, score=-2.0), "low_reward"),
    ]  # fmt: skip
    for made, reason in cases:
        assert rejection_reason(made, settings) == reason, made.text
    assert {reason for _, reason in cases} - {None} == set(REASONS)
    assert rejection_reason(planted(tokenizer, good, score=-2.0), FilterSettings()) is None  # no threshold set


def test_a_reward_model_scores_each_whole_candidate_at_its_last_token(setting):
    tokenizer = setting["tokenizer"]
    model = load_hf(setting["model"]).eval()
    torch.manual_seed(0)
    scorer = RewardModel(model, torch.randn(1, model.config.hidden_size), mean=0.5, std=2.0, path=setting["model"])
    prompts = read_prompts(setting["data"], tokenizer, domains=["rl"])[:3]
    settings = DrawSettings(n=2, temperature=1.0, max_new_tokens=24, max_turns=1)
    judged = draw(model, tokenizer, prompts, settings, FilterSettings(), 0, scorer)
    drawn = [c for candidates in judged for c in candidates]
    for c in drawn:
        ids = prompts[c.prompt].ids + c.episode.tokens
        alone = scorer.score(torch.tensor([ids]), torch.tensor([len(ids)]))
        assert c.score == pytest.approx(float((alone - 0.5) / 2.0), abs=1e-5)
    assert len({round(c.score, 4) for c in drawn}) > 1


def test_best_of_k_ranks_by_verifier_then_reward_model_then_draw(setting):
    tokenizer = setting["tokenizer"]
    drawn = [
        planted(tokenizer, "\n<think></think>\n2 + 2 = 5.\nAnswer: 5", score=3.0),  # wrong: dropped
        planted(tokenizer, "\n<think></think>\n2 + 2 = 4.\nAnswer: 4", score=0.5),
        planted(tokenizer, "\n<think></think>\nTwo and two.\nAnswer: 4", score=1.5),
        planted(tokenizer, "\n<think></think>\nSo it is 4.\nAnswer: 4", score=1.5),
    ]
    for number, made in enumerate(drawn):
        made.number = number
        made.reason = rejection_reason(made, FilterSettings())
    assert best(drawn).number == 2  # right, the highest score, drawn before its equal
    for made in drawn:
        made.score = None
    assert best(drawn).number == 1
    assert best(drawn[:1]) is None


def test_the_difficulty_filter_selects_prompts_by_their_share_of_right_candidates(setting):
    tokenizer = setting["tokenizer"]
    right, wrong = "\n<think></think>\n2 + 2 = 4.\nAnswer: 4", "\n<think></think>\n2 + 2 = 5.\nAnswer: 5"
    drawn = [[planted(tokenizer, right)] + [planted(tokenizer, wrong) for _ in range(3)],
             [planted(tokenizer, wrong) for _ in range(4)], [planted(tokenizer, right) for _ in range(4)]]  # fmt: skip
    prompts = []
    for index, candidates in enumerate(drawn):
        prompts.append(SamplePrompt(index, f"p{index}", "rl", [], [{"role": "user", "content": "What is 2 + 2?"}],
                                    None, 4, [{"role": "assistant", "content": "Answer: 4"}]))  # fmt: skip
        for c in candidates:
            c.prompt, c.reason = index, rejection_reason(c, FilterSettings())
    result = judged(prompts, drawn, "best", pass_rate=[0.2, 0.5])
    assert result["solved"] == {"1": 1, "0": 1, "4": 1}
    assert [index for index, _, _ in result["selected"]] == [0]  # 1 of 4 right: within; 0 and 4 of 4: not
    assert result["selected"][0][2]["messages"][-1] == {"role": "assistant", "content": "Answer: 4"}
    assert len(result["records"]) == 2 and result["prompts_without_sample"] == 1
    # the hard stage: pass@k = 0 and pass@n > 0. Prompt 0's one right candidate is its first; moved last, it counts
    hard = judged(prompts, drawn, "best", pass_rate=[0.01, 1.0], fail_first_k=2)
    assert [index for index, _, _ in hard["selected"]] == []  # prompt 0: right first; 2: all right; 1: none
    drawn[0] = drawn[0][1:] + drawn[0][:1]
    hard = judged(prompts, drawn, "best", pass_rate=[0.01, 1.0], fail_first_k=2)
    assert [index for index, _, _ in hard["selected"]] == [0]


def test_jsonl_prompts_take_the_reference_answer_and_name_a_bad_line(setting, tmp_path):
    tokenizer = setting["tokenizer"]
    messages = rl_prompt(random.Random(0))
    file = tmp_path / "prompts.jsonl"
    lines = [{"messages": messages, "id": "a"}, {"messages": messages[:-1], "domain": "open"}]
    file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    first, second = jsonl_prompts(file, tokenizer)
    assert first.answer == verify_answer(messages[-1]["content"]) and first.id == "a" and second.answer is None
    assert (
        tokenizer.decode(first.ids)
        == render_chat(messages[:-1], add_generation_prompt=True)
        == tokenizer.decode(second.ids)
    )
    file.write_text(json.dumps(lines[0]) + "\n" + json.dumps({"messages": [{"role": "robot", "content": "x"}]}))
    with pytest.raises(ValueError, match=f"{file}:2: .*role 'robot'"):
        jsonl_prompts(file, tokenizer)


def verify_answer(reply: str) -> int:
    return int(reply.rsplit("Answer:", 1)[1])


@pytest.fixture(scope="module")
def sampled(setting) -> dict:
    """`python run.py task=sample` on the prepared prompts in one process and in two tasks on two processes."""
    runs = {}
    for tasks in (1, 2):
        output = setting["root"] / f"tasks{tasks}" / "samples.jsonl"
        printed = run_py("task=sample", f"sample.model={setting['model']}", f"sample.prompts={setting['data']}",
                         f"sample.output={output}", f"sample.tasks={tasks}", "sample.num_workers=2", *SAMPLE,
                         f"hydra.run.dir={output.parent / 'run'}").stdout  # fmt: skip
        runs[tasks] = {"output": output, "printed": printed,
                       "manifest": json.loads(output.with_name("samples.jsonl.manifest.json").read_text())}  # fmt: skip
    return runs


@pytest.mark.slow
def test_samples_are_chat_that_source_chat_reads_and_the_manifest_adds_up(setting, sampled):
    run = sampled[1]
    manifest, lines = run["manifest"], run["output"].read_text().splitlines()
    assert manifest["prompts"] == 12 and manifest["candidates"] == 48
    assert manifest["candidates"] == manifest["kept"] + sum(manifest["dropped"].values())
    assert manifest["written"] == len(lines) == 12 - manifest["prompts_without_sample"] > 0
    assert all(len(manifest["examples"][r]) == min(3, n) for r, n in manifest["dropped"].items())
    assert f"wrote {len(lines)} conversations to {run['output']}" in run["printed"]
    ledger = Ledger()
    documents = list(read_chat([str(run["output"])], ledger))
    assert len(documents) == len(lines) and not ledger.dropped
    prompts = {p.id: p for p in read_prompts(setting["data"], setting["tokenizer"])}
    for line in map(json.loads, lines):
        prompt = prompts[line["id"].split("#")[0]]
        assert line["messages"][: len(prompt.messages)] == prompt.messages
        assert verify({"answer": prompt.answer}, line["messages"][-1]["content"]) == line["reward"] == 1.0
    # the difficulty filter: the prompts with at least 1 right candidate of 4, with their reference replies
    selected = [
        json.loads(line) for line in run["output"].with_name("samples.jsonl.prompts.jsonl").read_text().splitlines()
    ]
    assert (
        len(selected)
        == manifest["selected_prompts"]
        == sum(n for right, n in manifest["solved"].items() if right != "0")
    )
    assert sum(manifest["solved"].values()) == 12 and len(
        list(read_chat([str(run["output"]) + ".prompts.jsonl"], Ledger()))
    ) == len(selected)
    for record in selected:
        assert record["messages"] == prompts[record["id"]].messages + prompts[record["id"]].reference
        assert verify({"answer": prompts[record["id"]].answer}, record["messages"][-1]["content"]) == 1.0


@pytest.mark.slow
def test_two_processes_write_what_one_writes(sampled):
    one, two = sampled[1], sampled[2]
    assert two["output"].read_bytes() == one["output"].read_bytes()
    assert {**two["manifest"], "output": None} == {**one["manifest"], "output": None}
    assert len(list(two["output"].parent.glob("samples.jsonl.parts/part-*-of-00002.json"))) == 2


@pytest.mark.slurm
def test_on_slurm_the_parts_run_as_an_array_and_merge_to_what_one_process_writes(setting, sampled, tmp_path):
    """`-m 'sample.task=range(2)' cluster=local_slurm`: each part is a job of an array; the same command without
    sample.task merges the parts (sampling none again): the file and manifest equal one process's."""
    require_slurm()
    output = tmp_path / "samples.jsonl"
    command = ["task=sample", f"sample.model={setting['model']}", f"sample.prompts={setting['data']}",
               f"sample.output={output}", "sample.tasks=2", *SAMPLE]  # fmt: skip
    run_py("-m", *command, "sample.task=range(2)", "cluster=local_slurm", f"paths.sweep_dir={tmp_path / 'sweeps'}",
           "hydra.launcher.wait=true")  # fmt: skip
    assert len(list(tmp_path.glob("samples.jsonl.parts/part-*-of-00002.json"))) == 2 and not output.exists()
    merged = run_py(*command, f"hydra.run.dir={tmp_path / 'merge'}")
    assert "2 of 2 parts sampled before; sampling 0" in merged.stdout + merged.stderr
    one = sampled[1]
    assert output.read_bytes() == one["output"].read_bytes()
    manifest = json.loads(output.with_name("samples.jsonl.manifest.json").read_text())
    assert {**manifest, "output": None} == {**one["manifest"], "output": None}


def test_what_cannot_sample_is_refused_naming_the_key(setting, compose_config, tmp_path):
    base = ["task=sample", f"sample.model={setting['model']}", f"sample.prompts={setting['data']}",
            f"sample.output={tmp_path / 'out.jsonl'}"]  # fmt: skip
    validate(compose_config(*base))
    other = make_chat_dataset(tmp_path / "other", conversations=0, prompts=40, vocab_size=300)
    for overrides, message in [
        (["sample.prompts=null"], "sample.prompts: no prompts"),
        ([f"sample.prompts={tmp_path / 'missing.jsonl'}"], "sample.prompts=.*no such file"),
        ([f"sample.prompts={other}"], "sample.prompts"),  # another tokenizer: both files named
        (["sample.filters.min_reward=0.5"], "sample.filters.min_reward=0.5 needs a reward model"),
        ([f"sample.reward_model={setting['model']}"], "sample.reward_model=.*holds no reward model"),
        (["sample.tasks=2", "sample.task=2"], "sample.task=2"),
        (["sample.n=0"], "sample.n=0"),
        (["sample.fail_first_k=2"], r"sample\.fail_first_k=2: expected 1 <= k <= sample\.n=8, with sample\.pass_rate"),
        (["sample.pass_rate=[0.1,1]", "sample.fail_first_k=9"], r"sample\.fail_first_k=9: expected 1 <= k"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(compose_config(*base, *overrides))


GRAPH = """# @package _global_
defaults:
  - toy_stage
  - override /model: tiny
  - override /data: sft
  - override /phase: toy_sft
  - override /module: causal_lm
  - override /callbacks: default
  - _self_

model: {{vocab_size: 400}}
data: {{path: {data}, batch_size: 2}}
phase: {{seq_len: 128, mixture: {{sft: 0.0, rl: 1.0}}}}
trainer: {{max_steps: 3, val_check_interval: 3}}
callbacks: {{model_checkpoint: {{every_n_train_steps: 2}}}}
eval: {{after_train: false}}
init_from: "@unified"
stages:
  sample: [task=sample, sample.model={model}, sample.prompts={data}, "sample.domains=[rl]", sample.limit=24, sample.n=6,
           sample.batch_size=8, sample.keep=all, sample.temperature=0.7, sample.max_new_tokens=48]
  samples_data: [task=prepare, source=chat, "source.paths=[@sample]", prepare.tokenizer.path={model}/tokenizer.json,
                 prepare.dedup.near=false]
  unified: [data.path=@samples_data, trainer.max_steps=6, "+data.replay={{path: {data}, mixture: {{rl: 1.0}}}}"]
"""


@pytest.mark.slow
def test_a_stage_graph_killed_in_a_stage_resumes_without_sampling_again(setting, tmp_path):
    """sample -> prepare -> SFT on the samples with the prompts' conversations replayed -> the composition: killed in
    the SFT stage, then resumed: the finished stages are skipped, their files untouched."""
    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "graph.yaml").write_text(GRAPH.format(data=setting["data"], model=setting["model"]))
    run_dir = tmp_path / "run"
    command = ["experiment=graph", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", f"hydra.run.dir={run_dir}"]
    run_py(*command, *kill_at(3), killed=True)
    samples = run_dir / "stages" / "sample" / "samples.jsonl"
    made = {
        path: path.stat().st_mtime_ns
        for path in (samples, run_dir / "stages" / "samples_data" / "data" / "prepared.json")
    }
    assert not (run_dir / "stages" / "unified" / "hf").exists()
    assert (run_dir / "stages" / "unified" / "checkpoints" / "last.ckpt").is_file()
    resumed = run_py(*command, "ckpt_path=last", *UNKILLED).stdout
    assert "stage sample: finished before, skipped" in resumed and "stage samples_data: finished before" in resumed
    assert "1. sample (sample)\n  2. samples_data (prepare)\n  3. unified (train)\n  4. final (train)" in resumed
    assert {path: path.stat().st_mtime_ns for path in made} == made
    report = json.loads((run_dir / "curriculum.json").read_text())
    assert [(r["stage"], r["kind"], r["needs"]) for r in report] == [
        ("sample", "sample", []), ("samples_data", "prepare", ["sample"]), ("unified", "train", ["samples_data"]),
        ("toy_sft", "train", ["unified"]),
    ]  # fmt: skip
    assert (run_dir / "hf" / "config.json").is_file()


@pytest.mark.slow
def test_a_sample_stage_that_keeps_nothing_ends_the_graph_naming_why(setting, tmp_path):
    """Every candidate too short: the graph stops at the sample stage, naming it, the drop and an example, before the
    preparation after it reads an empty file."""
    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "graph.yaml").write_text(GRAPH.format(data=setting["data"], model=setting["model"]))
    run_dir = tmp_path / "run"
    result = forked.run(
        [sys.executable, "run.py", "experiment=graph", f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
         f"hydra.run.dir={run_dir}", "sample.limit=2", "sample.n=2", "sample.filters.min_reply_tokens=1000"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    manifest = run_dir / "stages" / "sample" / "samples.jsonl.manifest.json"
    assert result.returncode != 0 and manifest.is_file()
    assert "stage sample sampled no conversation: 4 of 4 candidates dropped as too_short, e.g. prompt " in " ".join(
        result.stderr.split()
    ), result.stderr[-2000:]
    assert str(manifest) in result.stderr and not (run_dir / "stages" / "samples_data" / "data").exists()
