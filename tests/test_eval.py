"""task=eval: lm-evaluation-harness over GLM46ForCausalLM on the prepared dataset's held-out documents, offline;
the same numbers and generations as lm-eval's own HFLM over the HF export."""

import csv
import io
import json
import logging
import re
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import read_write

from glm46.app.tasks import run_task
from glm46.config.schema import register_configs
from glm46.data.chat import ROLE_TOKENS
from glm46.data.documents import Ledger
from glm46.data.embedded import generated
from glm46.data.shards import load_shard, write_shards
from glm46.data.tokenizer import SPECIAL_TOKENS, GLMTokenizer
from glm46.data.windows import DomainStream
from glm46.errors import ConfigError
from glm46.eval import evaluate
from glm46.eval.lm_eval_tasks import STOP_TOKENS, write_tasks
from glm46.hf import save_hf
from glm46.rl.rewards import extract_answer

from .helpers import random_model, tiny_config
from .test_sft import make_chat_dataset

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
SETTINGS = ("eval.val_fraction=0.1", "eval.domain_val_fraction.rl=0.2", "eval.max_length=96", "eval.max_gen_toks=16")
SETTINGS += ("eval.ppl_chars=600",)
PPL_METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """test_sft's prepared chat dataset (rl and sft domains) with a generated `math` domain added."""
    root = make_chat_dataset(tmp_path_factory.mktemp("embedded"), conversations=60, prompts=150, vocab_size=512)
    math = "".join(json.dumps({"text": doc.text}) + "\n" for doc in generated(Ledger(), 200, 0, seed=0))
    (root / "documents" / "math.jsonl").write_text(math)
    write_shards(root, GLMTokenizer.from_file(root / "tokenizer.json"))
    return root


def export_random_model(dataset: Path, folder: Path, **config) -> Path:
    """A random model's HF export in the dataset's vocabulary. Special tokens other than the stop tokens are never
    the argmax (their lm_head rows are 0), as in a trained model: HFLM decodes without them, glm46 with them."""
    tokenizer = GLMTokenizer.from_file(dataset / "tokenizer.json")
    stops = [tokenizer.token_id(token) for token in STOP_TOKENS]
    config = tiny_config(vocab_size=tokenizer.vocab_size, eos_token_id=stops, pad_token_id=stops[0], **config)
    model = random_model(config, seed=0)
    with torch.no_grad():
        for token in set(SPECIAL_TOKENS) - set(STOP_TOKENS):
            model.lm_head.weight[tokenizer.token_id(token)] = 0
    return save_hf(model, folder / "hf")


@pytest.fixture(scope="module")
def model_dir(dataset, tmp_path_factory):
    return export_random_model(dataset, tmp_path_factory.mktemp("model"))


def compose_run(output_dir: Path, *overrides: str):
    """The composition of `python run.py <overrides> hydra.run.dir=<output_dir>`, with Hydra's runtime set."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["task=eval", *overrides], return_hydra_config=True)
    GlobalHydra.instance().clear()
    with read_write(cfg.hydra.runtime):
        cfg.hydra.runtime.output_dir = str(output_dir)
    HydraConfig.instance().set_config(cfg)
    return cfg


@pytest.fixture(scope="module")
def user_tasks(tmp_path_factory):
    """A user's own local task (include_path), and one whose data is on the Hub."""
    folder = tmp_path_factory.mktemp("user_tasks")
    (folder / "mine.jsonl").write_text("".join(json.dumps({"text": f"{n} + {n} = {2 * n}"}) + "\n" for n in range(3)))
    common = {"output_type": "loglikelihood_rolling", "test_split": "test", "doc_to_text": "", "doc_to_target": "text"}
    local = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(folder / "mine.jsonl")}}}
    (folder / "mine.yaml").write_text(yaml.safe_dump({"task": "my_sums", **local, **common}))
    (folder / "hub.yaml").write_text(yaml.safe_dump({"task": "my_hub", "dataset_path": "someone/data", **common}))
    return folder


@pytest.fixture(scope="module")
def evaluated(dataset, model_dir, user_tasks, tmp_path_factory):
    """`python run.py task=eval` on the random model, the glm46 tasks and the user's local task:
    (run directory, the task's summary, what it printed and logged)."""
    output_dir = tmp_path_factory.mktemp("run")
    overrides = [f"eval.model={model_dir.parent}", f"eval.dataset={dataset}", "eval.batch_size=16", *SETTINGS]
    cfg = compose_run(output_dir, *overrides, f"eval.include_path={user_tasks}", "eval.tasks=[glm46,my_sums]")
    logged, logger = logging.StreamHandler(io.StringIO()), logging.getLogger("glm46.eval.harness")
    logger.addHandler(logged)
    logger.setLevel(logging.INFO)  # as Hydra's logging sets it in a run
    try:
        with redirect_stdout(io.StringIO()) as printed:
            summary = run_task(cfg)
    finally:
        logger.removeHandler(logged)
        logger.setLevel(logging.NOTSET)
    return output_dir, summary, printed.getvalue() + logged.stream.getvalue()


@pytest.fixture(scope="module")
def tasks(dataset, tmp_path_factory):
    """The task files write_tasks makes of the dataset, and their names."""
    folder = tmp_path_factory.mktemp("tasks")
    return folder, write_tasks(compose_run(folder, f"eval.dataset={dataset}", *SETTINGS).eval, folder)


def held_out_documents(dataset: Path, domain: str, val_fraction: float = 0.1) -> list[np.ndarray]:
    tokens, offsets = load_shard(dataset / "tokens", domain)
    stream = DomainStream(tokens, offsets, val_fraction)
    return [stream.val[a:b] for a, b in zip(stream.val_offsets[:-1], stream.val_offsets[1:])]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_task_files_are_the_held_out_documents_by_absolute_path(dataset, tasks):
    folder, names = tasks
    domains = ["math", "rl", "sft"]
    assert names == ["glm46_arithmetic", "glm46_arithmetic_mc", *[f"glm46_ppl_{d}" for d in domains], "glm46"]
    for name in names[:-1]:
        config = yaml.safe_load((folder / f"{name}.yaml").read_text().replace("!function", ""))
        data = Path(config["dataset_kwargs"]["data_files"]["test"])
        assert data.is_absolute() and data.is_file()
    assert yaml.safe_load((folder / "glm46.yaml").read_text())["task"] == names[:-1]

    tokenizer = GLMTokenizer.from_file(dataset / "tokenizer.json")
    prompts, documents = records(folder / "glm46_arithmetic.jsonl"), held_out_documents(dataset, "rl", 0.2)
    assert len(prompts) == len(documents) == round(150 * 0.2)  # the rl domain's own share (data=rl's val_fraction)
    for prompt, ids in zip(prompts, documents):
        end = int(np.flatnonzero(ids == tokenizer.token_id(ROLE_TOKENS["assistant"]))[-1]) + 1
        assert tokenizer.encode(prompt["prompt"]) == ids[:end].tolist()  # special tokens included
        assert prompt["answer"] == extract_answer(tokenizer.decode(ids[end:].tolist()))

    questions, documents = records(folder / "glm46_arithmetic_mc.jsonl"), held_out_documents(dataset, "math")
    assert len(questions) == len(documents) == 20
    for question, ids in zip(questions, documents):
        text = tokenizer.decode(ids[:-1].tolist())
        assert question["question"] == text.split("\n")[0] + "\nAnswer:"
        assert len(set(question["choices"])) == 4 and question["choices"][question["gold"]] == str(extract_answer(text))

    for domain in domains:
        share = 0.2 if domain == "rl" else 0.1
        texts, documents = records(folder / f"glm46_ppl_{domain}.jsonl"), held_out_documents(dataset, domain, share)
        assert [t["text"] for t in texts] == [tokenizer.decode(ids[:-1].tolist())[:600] for ids in documents[:16]]


@pytest.mark.parametrize(
    "completion, score",
    [
        ("Left to right: 12 + 7 = 19.\nAnswer: 33", 1.0),
        ("Answer: 33<|endoftext|>Answer: 34", 1.0),
        ("Answer: 34", 0.0),
        ("The answer is 33", 0.0),
        ("Answer: thirty-three", 0.0),
    ],
)
def test_arithmetic_exact_match_scores_the_final_answer_through_the_task_hook(tasks, completion, score):
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks[0]), include_defaults=False)
    task = manager.load(["glm46_arithmetic"])["tasks"]["glm46_arithmetic"]
    assert task.process_results({"answer": 33}, [completion]) == {"exact_match": score}


@pytest.mark.slow
def test_task_eval_writes_lm_eval_results_logs_metrics_and_prints_the_table(evaluated, dataset):
    output_dir, summary, printed = evaluated
    results = json.loads((output_dir / "eval" / "results.json").read_text())
    assert results["config"]["model"] == "glm46" and "samples" not in results
    assert "|Version|Filter|n-shot|" in printed  # lm-eval's table
    for kind in ("generation", "log-likelihoods"):  # progress while the requests run, and when they are done
        assert re.search(rf"eval {kind}: (\d+)/\1 requests \(100%\), [\d.]+/s, done in", printed), kind
    metrics = {
        "glm46_arithmetic": ["exact_match"],
        "glm46_arithmetic_mc": ["acc"],
        **{f"glm46_ppl_{d}": PPL_METRICS for d in ("math", "rl", "sft")},
        "my_sums": ["word_perplexity"],  # lm-eval's default metric of a rolling-loglikelihood task
    }
    for task, names in metrics.items():
        assert all(isinstance(results["results"][task][f"{m},none"], float) for m in names), task
        assert all(f"{task}/{m}" in summary for m in names) and task in printed
        assert (output_dir / "eval" / f"samples_{task}.jsonl").is_file()
    assert summary["glm46_arithmetic/n"] == len(held_out_documents(dataset, "rl", 0.2)) == 30
    assert summary["my_sums/n"] == 3
    with open(output_dir / "metrics.csv") as file:
        (row,) = list(csv.DictReader(file))
    assert float(row["eval/glm46_arithmetic_mc/acc"]) == summary["glm46_arithmetic_mc/acc"]
    assert not any("stderr" in column for column in row)


@pytest.mark.slow
def test_glm46_equals_lm_eval_hflm_over_the_hf_export(evaluated, dataset, model_dir):
    """Per-sample log-likelihoods (multiple choice and rolling) and metrics within 1e-4 relative, greedy
    generations equal, from lm-eval's HFLM over transformers' Glm4MoeForCausalLM on the same tasks."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(dataset / "tokenizer.json"), eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    settings = {"device": "cpu", "dtype": "float32", "batch_size": 16, "max_length": 96}  # evaluated's
    hflm = HFLM(pretrained=str(model_dir), tokenizer=tokenizer, **settings)
    tasks = TaskManager(include_path=str(evaluated[0] / "eval" / "tasks"), include_defaults=False)
    reference = simple_evaluate(model=hflm, tasks=["glm46"], task_manager=tasks, bootstrap_iters=0)
    ours = json.loads((evaluated[0] / "eval" / "results.json").read_text())
    for task, samples in reference["samples"].items():
        for key, value in reference["results"][task].items():
            if "," in key and "stderr" not in key:
                assert ours["results"][task][key] == pytest.approx(value, rel=1e-4), (task, key)
        mine = records(evaluated[0] / "eval" / f"samples_{task}.jsonl")
        assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in samples]
        for sample, theirs in zip(mine, samples):
            if task == "glm46_arithmetic":
                assert sample["filtered_resps"] == theirs["filtered_resps"]  # the same greedy reply
            elif task == "glm46_arithmetic_mc":
                assert [greedy for _, greedy in sample["filtered_resps"]] == [g for _, g in theirs["filtered_resps"]]
                lls = [ll for ll, _ in sample["filtered_resps"]]
                assert lls == pytest.approx([ll for ll, _ in theirs["filtered_resps"]], rel=1e-4)
            else:
                assert sample["filtered_resps"] == pytest.approx(theirs["filtered_resps"], rel=1e-4)


def test_task_eval_needs_a_model(tmp_path):
    with pytest.raises(ConfigError, match="eval.model: no model to evaluate"):
        run_task(compose_run(tmp_path))


@pytest.mark.parametrize(
    "tasks, message",
    [
        ("[nope]", r"unknown task 'nope': not a glm46 task \(glm46_arithmetic, .*glm46_ppl_sft, glm46\)"),
        ("[hellaswag]", r"hellaswag is lm-eval.s benchmark over the Hub dataset Rowan/hellaswag.*benchmark_dir=DIR"),
        ("[arithmetic_1dc]", r"'arithmetic_1dc' reads its data from hf://datasets/EleutherAI/arithmetic/.*local"),
        ("[glm46,my_hub]", r"task 'my_hub' reads its data from the Hugging Face Hub dataset someone/data.*local"),
    ],
)
def test_unknown_and_hub_tasks_are_refused_before_loading_the_model(dataset, user_tasks, tmp_path, tasks, message):
    cfg = compose_run(tmp_path, f"eval.dataset={dataset}", f"eval.include_path={user_tasks}", f"eval.tasks={tasks}")
    with pytest.raises(ConfigError, match=message):
        evaluate(cfg.eval, tmp_path / "no model here", tmp_path)


def test_a_directory_without_weights_is_named(dataset, tmp_path):
    cfg = compose_run(tmp_path, f"eval.dataset={dataset}", "eval.tasks=[glm46_ppl_sft]")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'empty'} holds no model: neither config.json"):
        evaluate(cfg.eval, tmp_path / "empty", tmp_path)


@pytest.fixture(scope="module")
def tool_dataset(tmp_path_factory):
    return make_chat_dataset(tmp_path_factory.mktemp("tools"), 40, 40, vocab_size=512, tool_prompts=60)


def scripted_generate(lm, calls: bool):
    """In place of the model's `generate`: GLM's calculator call for the context's question (or, with calls=False, a
    wrong answer at once); after a tool result, the answer it read."""
    call = "\n<think></think>\n<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>{}</arg_value>"
    call += "\n</tool_call>"

    def generate(ids, max_new_tokens, temperature, eos_token_id=None, attention_mask=None, **_):
        turns = []
        for row, mask in zip(ids.tolist(), attention_mask.tolist()):
            context = lm.tokenizer.decode([token for token, real in zip(row, mask) if real])
            if context.endswith("</tool_response><|assistant|>"):
                result = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context)[-1]
                turn = f"\n<think></think>\nAnswer: {result}<|endoftext|>"
            elif calls:
                turn = call.format(re.findall(r"What is (.*?)\?", context)[-1]) + "<|observation|>"
            else:
                turn = "\n<think></think>\nAnswer: 0<|endoftext|>"
            turns.append(lm.tokenizer.encode(turn)[:max_new_tokens])
        width = max(map(len, turns))
        new = [turn + [lm.eot_token_id] * (width - len(turn)) for turn in turns]
        return torch.cat([ids, torch.tensor(new)], dim=1)

    return generate


@pytest.mark.parametrize("calls", [True, False])
def test_the_tool_task_plays_each_prompt_as_a_tool_episode_and_scores_its_last_turn(tool_dataset, tmp_path, calls):
    """glm46_tool_arithmetic through lm-eval's own evaluator: the harness serves the calculator's calls for real."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from glm46.eval.harness import GLM46LM

    folder = tmp_path / "tasks"
    settings = compose_run(tmp_path, f"eval.dataset={tool_dataset}", "eval.max_gen_toks=48").eval  # per turn
    assert "glm46_tool_arithmetic" in write_tasks(settings, folder)
    tokenizer = GLMTokenizer.from_file(tool_dataset / "tokenizer.json")
    config = tiny_config(vocab_size=tokenizer.vocab_size, max_position_embeddings=1024)
    lm = GLM46LM(str(save_hf(random_model(config, seed=0), tmp_path / "hf")), str(tool_dataset / "tokenizer.json"))
    lm.model.generate = scripted_generate(lm, calls)
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    results = simple_evaluate(lm, tasks=["glm46_tool_arithmetic"], task_manager=manager, bootstrap_iters=0)
    metrics, samples = results["results"]["glm46_tool_arithmetic"], results["samples"]["glm46_tool_arithmetic"]
    assert len(samples) == results["n-samples"]["glm46_tool_arithmetic"]["effective"] > 0
    assert metrics["exact_match,none"] == metrics["tool_calls,none"] == float(calls)
    transcript, answer = samples[0]["resps"][0][0], samples[0]["doc"]["answer"]
    if calls:  # the model's call, the calculator's result as GLM-4.6's template writes it, the model's answer
        assert f"</tool_call><|observation|>\n<tool_response>\n{answer}\n</tool_response><|assistant|>" in transcript
        assert transcript.endswith(f"Answer: {answer}<|endoftext|>")
    else:
        assert transcript == "\n<think></think>\nAnswer: 0<|endoftext|>"
