"""lm-eval's own benchmarks (gsm8k, an MMLU subject, a BBH task, a MATH subject, AIME 25, IFEval) on local copies
of their data, through glm46's model wrapper: lm-eval's HFLM on the same export gives the same scores; a missing copy
(or IFEval's NLTK data) is refused at composition, naming the folder."""

import io
import json
import os
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
BBH = [
    {"input": f"{a} and not {b} is", "target": str(a and not b)}
    for a, b in [(True, False), (False, True), (True, True)]
]
MATH = [
    {"problem": f"Solve for $x$: $x + {a} = {b}$.", "level": "Level 1", "type": "Algebra",
     "solution": f"Subtract {a}: $x = \\boxed{{{b - a}}}$."}
    for a, b in [(1, 5), (2, 9), (3, 4), (7, 10), (4, 4)]
]  # fmt: skip
AIME = [{"id": i, "problem": f"Find the remainder when ${a}^2$ is divided by 1000.", "answer": str(a * a % 1000)}
        for i, a in enumerate([37, 101, 999])]  # fmt: skip
# Not change_case:english_lowercase: its check asks langdetect, which draws at random (lm-eval does not seed it), and
# on a random model's words two runs disagree
IFEVAL = [
    {"key": 1, "prompt": "Write about apples in fewer than 3 sentences.",
     "instruction_id_list": ["length_constraints:number_sentences"],
     "kwargs": [{"relation": "less than", "num_sentences": 3}]},
    {"key": 2, "prompt": "Describe a river. Do not use any commas.", "instruction_id_list": ["punctuation:no_comma"],
     "kwargs": [{}]},
    {"key": 3, "prompt": "Name a colour, with a title, in double quotes.",
     "instruction_id_list": ["startend:quotation", "detectable_format:title"], "kwargs": [{}, {}]},
]  # fmt: skip


def write_jsonl(path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_punkt_tab(nltk_data) -> None:
    """NLTK's punkt_tab layout, trained here on Python's documentation (nltk.downloader's is not reachable)."""
    from pydoc_data.topics import topics

    from nltk.tokenize.punkt import PunktTrainer, TabEncoder

    trainer = PunktTrainer()
    trainer.train("\n".join(list(topics.values())[:50]), finalize=True)
    params, encode, english = trainer.get_params(), TabEncoder(), nltk_data / "tokenizers" / "punkt_tab" / "english"
    english.mkdir(parents=True)
    (english / "collocations.tab").write_text(encode.tups2tab(params.collocations))
    (english / "sent_starters.txt").write_text(encode.set2txt(params.sent_starters))
    (english / "abbrev_types.txt").write_text(encode.set2txt(params.abbrev_types))
    (english / "ortho_context.tab").write_text(encode.ivdict2tab(params.ortho_context))


@pytest.fixture(scope="module")
def benchmark_dir(tmp_path_factory):
    """gsm8k in the Hub's layout (openai/gsm8k's main/<split>-00000-of-00001.parquet), the others as JSONL by split
    with their Hub datasets' columns (in a configuration's folder where the task names one), IFEval with its NLTK
    data, as a user copies them to an offline cluster."""
    root = tmp_path_factory.mktemp("benchmarks")
    (root / "gsm8k" / "main").mkdir(parents=True)
    for split, rows in (("test", GSM8K[:4]), ("train", GSM8K[4:])):
        Dataset.from_list(rows).to_parquet(root / "gsm8k" / "main" / f"{split}-00000-of-00001.parquet")
    subject = root / "mmlu_elementary_mathematics"
    subject.mkdir()
    for split, rows in (("test", MMLU[:5]), ("dev", MMLU[5:]), ("validation", MMLU[5:])):
        write_jsonl(subject / f"{split}.jsonl", rows)
    write_jsonl(root / "bbh_cot_fewshot_boolean_expressions" / "boolean_expressions" / "test.jsonl", BBH)
    for split, rows in (("test", MATH[:3]), ("train", MATH[3:])):
        write_jsonl(root / "hendrycks_math_algebra" / "algebra" / f"{split}.jsonl", rows)
    write_jsonl(root / "aime25" / "test.jsonl", AIME)
    write_jsonl(root / "ifeval" / "train.jsonl", IFEVAL)
    write_punkt_tab(root / "ifeval" / "nltk_data")
    return root


NAMES = [
    "gsm8k", "mmlu_elementary_mathematics", "bbh_cot_fewshot_boolean_expressions", "hendrycks_math_algebra", "aime25",
    "ifeval",
]  # fmt: skip
SIZES = {"gsm8k": 4, "mmlu_elementary_mathematics": 5, "bbh_cot_fewshot_boolean_expressions": 3,
         "hendrycks_math_algebra": 3, "aime25": 3, "ifeval": 3}  # fmt: skip
TASKS = f"eval.tasks=[{','.join(NAMES)}]"


@pytest.fixture(scope="module")
def evaluated(dataset, model_dir, benchmark_dir, tmp_path_factory):  # noqa: F811
    output_dir = tmp_path_factory.mktemp("run")
    overrides = [f"eval.dataset={dataset}", f"eval.benchmark_dir={benchmark_dir}", TASKS, "eval.max_gen_toks=8"]
    overrides.append("+eval.gen_kwargs.max_gen_toks=8")  # BBH asks for 1,024 tokens, IFEval 1,280, AIME 32,768
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
    assert set(ours["results"]) == set(NAMES)
    assert {name: ours["n-samples"][name]["effective"] for name in NAMES} == SIZES
    assert "gsm8k exact_match/strict-match: " in printed and "n=4" in printed
    assert "mmlu_elementary_mathematics acc: " in printed and "(95% CI [" in printed
    assert "ifeval prompt_level_strict_acc: " in printed and "hendrycks_math_algebra exact_match: " in printed
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(dataset / "tokenizer.json"), eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )

    class Reference(HFLM):
        max_gen_toks = 8  # evaluated's eval.max_gen_toks (HFLM's own is 256)

    hflm = Reference(
        pretrained=str(model_dir), tokenizer=tokenizer, device="cpu", dtype="float32", batch_size=8, max_length=1024
    )
    manager = TaskManager(include_path=sorted({str(benchmark_folder(n)) for n in NAMES}), include_defaults=False)
    with local_copies(local_sources(NAMES, str(benchmark_dir)), output_dir / "reference_cache"):
        reference = simple_evaluate(model=hflm, tasks=NAMES, task_manager=manager, bootstrap_iters=0, random_seed=0,
                                    numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
                                    gen_kwargs={"max_gen_toks": 8})  # fmt: skip
    assert os.path.join(benchmark_dir, "ifeval", "nltk_data") not in __import__("nltk").data.path  # put back
    for task in NAMES:
        for key, value in reference["results"][task].items():
            if "," in key and "stderr" not in key:
                assert ours["results"][task][key] == pytest.approx(value, rel=1e-4), (task, key)
    for mine, theirs in zip(
        ours["samples"]["mmlu_elementary_mathematics"], reference["samples"]["mmlu_elementary_mathematics"]
    ):
        assert [ll for ll, _ in mine["filtered_resps"]] == pytest.approx(
            [ll for ll, _ in theirs["filtered_resps"]], rel=1e-4
        )
    for task in NAMES[:1] + NAMES[2:]:  # generation: the same prompts (gsm8k's 5 shots from the local train split)
        for mine, theirs in zip(ours["samples"][task], reference["samples"][task], strict=True):
            assert mine["arguments"] == theirs["arguments"], task
            assert mine["resps"] == theirs["resps"] and mine["filtered_resps"] == theirs["filtered_resps"], task


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


def test_ifeval_without_its_nltk_data_and_minerva_math_are_refused_at_composition(dataset, model_dir, tmp_path):  # noqa: F811
    root = tmp_path / "benchmarks"
    write_jsonl(root / "ifeval" / "train.jsonl", IFEVAL)
    write_jsonl(root / "minerva_math_algebra" / "algebra" / "test.jsonl", MATH)
    base = [f"eval.model={model_dir}", f"eval.dataset={dataset}", f"eval.benchmark_dir={root}"]
    punkt = root / "ifeval" / "nltk_data" / "tokenizers" / "punkt_tab" / "english"
    with pytest.raises(ConfigError, match=rf"ifeval's checkers read {punkt}, which is missing .*nltk\.downloader"):
        validate(compose_run(tmp_path, *base, "eval.tasks=[ifeval]"))
    with pytest.raises(ConfigError, match=r"minerva_math_algebra cannot run: .*antlr4.*hendrycks_math"):
        validate(compose_run(tmp_path, *base, "eval.tasks=[minerva_math_algebra]"))
