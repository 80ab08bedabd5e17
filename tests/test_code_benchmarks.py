"""HumanEval and MBPP as lm-eval defines them, their programs run in the sandbox: lm-eval's prompts and filters, the
unbiased pass@k, a sandbox failure left out of the mean (never 0), and the refusal where no sandbox can run."""

import math

import pytest
from datasets import Dataset
from lm_eval import simple_evaluate
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

from glm46.config.checks import validate
from glm46.errors import ConfigError
from glm46.eval.benchmarks import local_copies, local_sources
from glm46.eval.code_tasks import estimate_pass_at_k, pass_at_k, sandboxed
from glm46.eval.evaluation import write_code_tasks
from glm46.sandbox import Limits, Sandbox

from .test_eval import compose_run

pytestmark = pytest.mark.sandbox

HUMANEVAL = [  # openai/openai_humaneval's columns
    {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "entry_point": "add",
     "canonical_solution": "    return a + b\n", "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"},
    {"task_id": "HumanEval/1", "prompt": "def double(x):\n", "entry_point": "double",
     "canonical_solution": "    return 2 * x\n", "test": "def check(candidate):\n    assert candidate(4) == 8\n"},
]  # fmt: skip
MBPP = [  # google-research-datasets/mbpp's (configuration `full`)
    {"task_id": 11, "text": "Write a function to add two numbers.", "code": "def add(a, b):\n    return a + b",
     "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 2) == 4"], "test_setup_code": "",
     "challenge_test_list": []},
    {"task_id": 12, "text": "Write a function to double a number.", "code": "def double(x):\n    return 2 * x",
     "test_list": ["assert double(1) == 2", "assert double(0) == 0", "assert double(4) == 8"], "test_setup_code": "",
     "challenge_test_list": []},
]  # fmt: skip
# What the model writes, by the function its prompt asks for: right for add, wrong for double
REPLIES = {
    "humaneval": {"def add(a, b):\n": "    return a + b\n", "def double(x):\n": "    return x + 1\n"},
    "mbpp": {"add two numbers": "def add(a, b):\n    return a + b\n",
             "double a number": "def double(x):\n    return x\n"},
}  # fmt: skip


class FixedReplies(LM):
    """An lm-eval model whose reply to a prompt is the REPLIES entry its prompt's last lines name."""

    def __init__(self, replies: dict[str, str]):
        super().__init__()
        self.replies = replies

    def generate_until(self, requests):
        return [next(r for key, r in self.replies.items() if key in req.args[0][-300:]) for req in requests]

    def loglikelihood(self, requests):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError


@pytest.fixture(scope="module")
def benchmark_dir(tmp_path_factory):
    """Both in the Hub's layout: humaneval's test split, mbpp's configuration folder `full`."""
    root = tmp_path_factory.mktemp("benchmarks")
    for folder, rows in (("humaneval", HUMANEVAL), ("mbpp/full", MBPP)):
        (root / folder).mkdir(parents=True)
        Dataset.from_list(rows).to_parquet(root / folder / "test-00000-of-00001.parquet")
    return root


@pytest.mark.parametrize("name, metric", [("humaneval", "pass@1,create_test"), ("mbpp", "pass@1,none")])
def test_the_code_benchmarks_score_lm_evals_programs_in_the_sandbox(benchmark_dir, tmp_path, name, metric):
    assert write_code_tasks([name, "gsm8k"], tmp_path) == [name]
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    with local_copies(local_sources([name], str(benchmark_dir)), tmp_path / "cache"):
        with sandboxed(Sandbox(limits=Limits(wall_seconds=5.0))) as counts:
            model = FixedReplies(REPLIES[name])
            results = simple_evaluate(model=model, tasks=[name], task_manager=manager, bootstrap_iters=0)
    assert results["results"][name][metric] == 0.5 and counts["sandbox_errors"] == 0
    if name == "humaneval":  # lm-eval's build_predictions: the prompt, then the reply
        programs = [s["filtered_resps"][0] for s in results["samples"][name]]  # one repeat per document
        assert programs == [[doc["prompt"] + REPLIES[name][doc["prompt"]]] for doc in HUMANEVAL]
    else:  # 3-shot, lm-eval's own few-shot samples (its utils.list_fewshot_samples)
        assert "similar_elements" in results["samples"][name][0]["arguments"][0][0]


def test_pass_at_k_is_the_unbiased_estimator_over_the_samples():
    def reference(n, c, k):  # human-eval's estimator (Chen et al. 2021), in closed form
        return 1.0 if n - c < k else 1 - math.comb(n - c, k) / math.comb(n, k)

    for n, c, k in [(1, 0, 1), (1, 1, 1), (10, 3, 1), (10, 3, 5), (64, 7, 16), (5, 4, 2)]:
        assert estimate_pass_at_k(n, c, k) == pytest.approx(reference(n, c, k), rel=1e-12)
    test = "def check(candidate):\n    assert candidate(2) == 4\ncheck(square)"
    programs = [
        "def square(x):\n    return x * x\n",
        "def square(x):\n    return x + 2\n",
        "def square(x):\n    return 4\n",
        "def square(x):\n    return x + x + 1\n",
    ]  # fmt: skip  (right, right at 2, right at 2, wrong)
    with sandboxed(Sandbox(limits=Limits(wall_seconds=5.0))):
        scores = pass_at_k([test], [programs], k=[1, 2])
    assert scores == {"pass@1": pytest.approx(0.75), "pass@2": pytest.approx(reference(4, 3, 2))}


def test_a_sandbox_that_cannot_start_leaves_the_document_out(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with sandboxed(Sandbox()) as counts:
        scores = pass_at_k(["assert True"], [["x = 1"]], k=1)
    assert scores == {"pass@1": None} and counts["sandbox_errors"] == 1


def test_code_benchmarks_without_a_sandbox_are_refused_at_composition(benchmark_dir, tmp_path, monkeypatch):
    base = ["eval.model=/nowhere", f"eval.benchmark_dir={benchmark_dir}", "eval.tasks=[humaneval]"]
    validate(compose_run(tmp_path, *base))
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap to be found
    with pytest.raises(ConfigError, match=r"humaneval run model-written programs, and no sandbox can run them"):
        validate(compose_run(tmp_path, *base))
    validate(compose_run(tmp_path, *base, "eval.sandbox=none"))
