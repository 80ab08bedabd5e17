"""lm-eval's own benchmarks (gsm8k, an MMLU subject) on local copies of their data, through glm46's model wrapper:
lm-eval's HFLM on the same export gives the same scores; a missing copy is refused at composition, naming the folder."""

import io
import json
from contextlib import redirect_stdout

import pytest
from datasets import Dataset

from glm46.config.checks import validate
from glm46.errors import ConfigError
from glm46.eval import evaluate
from glm46.eval.benchmarks import local_copies, local_sources

from .test_eval import compose_run, dataset, export_random_model  # noqa: F401 - the fixture


@pytest.fixture(scope="module")
def model_dir(dataset, tmp_path_factory):  # noqa: F811
    """test_eval's random export, with room for gsm8k's 5-shot prompts (1,024 positions)."""
    return export_random_model(dataset, tmp_path_factory.mktemp("model"), max_position_embeddings=1024)


GSM8K = [
    {"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?", "answer": f"{a} + {b} = "
     f"{a + b}\n#### {a + b}"}
    for a, b in [(3, 4), (10, 5), (7, 8), (2, 9), (6, 6), (12, 1), (4, 4), (9, 3), (5, 5), (8, 1)]
]  # fmt: skip
MMLU = [
    {"question": f"What is {a} + {b}?", "subject": "elementary_mathematics", "choices": [str(a + b + d) for d in
     (0, 1, 2, 3)], "answer": 0}
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 9), (4, 1), (6, 3), (5, 2), (8, 8), (3, 3)]
]  # fmt: skip


@pytest.fixture(scope="module")
def benchmark_dir(tmp_path_factory):
    """gsm8k in the Hub's layout (openai/gsm8k's main/<split>-00000-of-00001.parquet), an MMLU subject as JSONL by
    split (cais/mmlu's columns), as a user copies them to an offline cluster."""
    root = tmp_path_factory.mktemp("benchmarks")
    (root / "gsm8k" / "main").mkdir(parents=True)
    for split, rows in (("test", GSM8K[:4]), ("train", GSM8K[4:])):
        Dataset.from_list(rows).to_parquet(root / "gsm8k" / "main" / f"{split}-00000-of-00001.parquet")
    subject = root / "mmlu_elementary_mathematics"
    subject.mkdir()
    for split, rows in (("test", MMLU[:5]), ("dev", MMLU[5:]), ("validation", MMLU[5:])):
        (subject / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


TASKS = "eval.tasks=[gsm8k,mmlu_elementary_mathematics]"


@pytest.fixture(scope="module")
def evaluated(dataset, model_dir, benchmark_dir, tmp_path_factory):  # noqa: F811
    output_dir = tmp_path_factory.mktemp("run")
    overrides = [f"eval.dataset={dataset}", f"eval.benchmark_dir={benchmark_dir}", TASKS, "eval.max_gen_toks=8"]
    cfg = compose_run(output_dir, *overrides, "eval.max_length=1024", "eval.batch_size=8")
    with redirect_stdout(io.StringIO()) as printed:
        results = evaluate(cfg.eval, model_dir, output_dir)
    return output_dir, results, printed.getvalue()


@pytest.mark.slow
def test_the_benchmarks_score_as_lm_evals_hflm_on_the_same_export(evaluated, benchmark_dir, dataset, model_dir):  # noqa: F811
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import PreTrainedTokenizerFast

    from glm46.eval.benchmarks import benchmark_folder

    output_dir, ours, printed = evaluated
    assert set(ours["results"]) == {"gsm8k", "mmlu_elementary_mathematics"}
    assert (
        ours["n-samples"]["gsm8k"]["effective"] == 4
        and ours["n-samples"]["mmlu_elementary_mathematics"]["effective"] == 5
    )
    assert "gsm8k exact_match/strict-match: " in printed and "n=4" in printed
    assert "mmlu_elementary_mathematics acc: " in printed and "(95% CI [" in printed
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(dataset / "tokenizer.json"), eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )

    class Reference(HFLM):
        max_gen_toks = 8  # evaluated's eval.max_gen_toks (HFLM's own is 256)

    hflm = Reference(
        pretrained=str(model_dir), tokenizer=tokenizer, device="cpu", dtype="float32", batch_size=8, max_length=1024
    )
    names = ["gsm8k", "mmlu_elementary_mathematics"]
    manager = TaskManager(include_path=[str(benchmark_folder(n)) for n in names], include_defaults=False)
    with local_copies(local_sources(names, str(benchmark_dir)), output_dir / "reference_cache"):
        reference = simple_evaluate(model=hflm, tasks=names, task_manager=manager, bootstrap_iters=0, random_seed=0,
                                    numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)  # fmt: skip
    for task in names:
        for key, value in reference["results"][task].items():
            if "," in key and "stderr" not in key:
                assert ours["results"][task][key] == pytest.approx(value, rel=1e-4), (task, key)
    for mine, theirs in zip(
        ours["samples"]["mmlu_elementary_mathematics"], reference["samples"]["mmlu_elementary_mathematics"]
    ):
        assert [ll for ll, _ in mine["filtered_resps"]] == pytest.approx(
            [ll for ll, _ in theirs["filtered_resps"]], rel=1e-4
        )
    for mine, theirs in zip(ours["samples"]["gsm8k"], reference["samples"]["gsm8k"]):
        assert mine["arguments"] == theirs["arguments"]  # the same 5-shot prompt from the local train split
        assert mine["resps"] == theirs["resps"] and mine["filtered_resps"] == theirs["filtered_resps"]


def test_a_benchmark_without_its_local_copy_is_refused_at_composition(dataset, model_dir, benchmark_dir, tmp_path):  # noqa: F811
    base = [f"eval.model={model_dir}", f"eval.dataset={dataset}"]
    with pytest.raises(
        ConfigError, match=r"gsm8k is lm-eval's benchmark over the Hub dataset openai/gsm8k.*eval.benchmark_dir=DIR"
    ):
        validate(compose_run(tmp_path, *base, "eval.tasks=[gsm8k]"))
    with pytest.raises(
        ConfigError, match=rf"no data for mmlu_anatomy in {benchmark_dir / 'mmlu_anatomy'} \(expected cais/mmlu"
    ):
        validate(compose_run(tmp_path, *base, f"eval.benchmark_dir={benchmark_dir}", "eval.tasks=[gsm8k,mmlu_anatomy]"))
    validate(compose_run(tmp_path, *base, f"eval.benchmark_dir={benchmark_dir}", TASKS))
