"""A prepared dataset's held-out documents as lm-evaluation-harness tasks, written beside each evaluation so
that they always match the dataset it reads (glm46.eval.evaluate writes them into <output dir>/eval/tasks/).

Held out means exactly what the DataModules hold out: the last `val_fraction` of each domain's documents
(glm46.data.windows.DomainStream; 0.02 by default, as theirs), read from the token shards and decoded.

- `glm46_arithmetic` (generate_until, exact_match): the `rl` domain's chat prompts, up to and including
  <|assistant|>; a reply scores 1 when its final answer (glm46.rl.rewards.extract_answer) is the reference's integer.
- `glm46_tool_arithmetic` (generate_until with tools, exact_match and tool_calls): the `tool` domain's prompts
  (`What is A * B?` in a chat that offers the calculator), each played as a greedy tool episode of up to
  TOOL_TURNS turns of up to max_gen_toks tokens (glm46.eval.harness serves the calls for real);
  exact_match scores the last turn's final answer, tool_calls is the share of episodes in which a call was served.
- `glm46_style` (generate_until, follows_style and exact_match): the `style` domain's prompts (the generated
  preference task, glm46.data.preference_task), each asking for a brief or a worked reply; follows_style is the
  task's hidden rule, exact_match the verifier's.
- `glm46_arithmetic_mc` (multiple_choice, acc): the `math` domain's questions as `Question: What is a + b?\\nAnswer:`,
  the right integer among three seeded distractors (the other operations' results, off by one or by ten).
- `glm46_ppl_<domain>` (loglikelihood_rolling; word_perplexity, byte_perplexity, bits_per_byte): the first
  `ppl_documents` held-out documents of each domain, cut to `ppl_chars` characters. A domain with no
  held-out document (too few documents for its fraction) has no task.
- `glm46`: the group of them all.

Each task is a YAML file over a JSONL file named by absolute path (lm-eval resolves a relative `data_files`
entry from the current directory), with the datasets library's Arrow copy kept beside it.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import yaml
from omegaconf import DictConfig

from glm46.data.chat import ROLE_TOKENS, STOP_TOKENS, ChatTokens, reply_span
from glm46.data.shards import load_shard, read_index
from glm46.data.tokenizer import GLMTokenizer
from glm46.data.windows import DomainStream
from glm46.rl.rewards import extract_answer, verify
from glm46.rl.style_rule import follows_style, requested_style

GROUP = "glm46"
TOOL_TURNS = 2  # of a tool episode: a call, then the answer
PPL_METRICS = {  # lm-eval's metric -> its aggregation
    "word_perplexity": "weighted_perplexity",
    "byte_perplexity": "weighted_perplexity",
    "bits_per_byte": "bits_per_byte",
}
_QUESTION = re.compile(r"Question: What is (\d+) ([-+*]) (\d+)\?")


def score_arithmetic(doc: dict, results: list[str]) -> dict[str, float]:
    """glm46_arithmetic's process_results hook: 1.0 when the reply's final answer is the reference integer."""
    return {"exact_match": verify(doc, results[0])}


def score_style(doc: dict, results: list[str]) -> dict[str, float]:
    """glm46_style's: whether the reply follows the style its prompt asks for (the generated preference task's hidden
    rule, glm46.data.preference_task), and whether its final answer is right."""
    return {"follows_style": float(follows_style(doc["style"], results[0])), "exact_match": verify(doc, results[0])}


def score_tool_arithmetic(doc: dict, results: list[str]) -> dict[str, float]:
    """glm46_tool_arithmetic's: the last turn of the episode's transcript (glm46.eval.harness) scored as a reply, and
    whether a tool call was served on the way."""
    transcript = results[0]
    last_turn = transcript.rpartition(ROLE_TOKENS["assistant"])[2]
    return {"exact_match": verify(doc, last_turn), "tool_calls": float("<tool_response>" in transcript)}


class Function(str):
    """A `!function module.attribute` reference in a task YAML, which lm-eval imports."""


class TaskDumper(yaml.SafeDumper):
    """yaml.safe_dump's writer, writing a Function as lm-eval's `!function` tag."""


TaskDumper.add_representer(Function, lambda dumper, value: dumper.represent_scalar("!function", str(value)))


def names_own(tasks) -> bool:
    """Whether eval.tasks names any of glm46's own tasks (the group `glm46` or a `glm46_*` task), which are written
    from eval.dataset."""
    return any(str(name) == GROUP or str(name).startswith(f"{GROUP}_") for name in tasks)


def prepared(dataset: str | Path) -> bool:
    return (Path(dataset) / "tokens" / "shards.json").is_file()


def write_task_yaml(path: Path, task: dict) -> None:
    path.write_text(yaml.dump(task, Dumper=TaskDumper, sort_keys=False, allow_unicode=True))


def held_out(tokens_dir: Path, domain: str, val_fraction: float) -> tuple[int, list[np.ndarray]]:
    """(number of the first held-out document, the held-out documents' ids, each ending with <|endoftext|>)."""
    tokens, offsets = load_shard(tokens_dir, domain)
    stream = DomainStream(tokens, offsets, val_fraction)
    ends = stream.val_offsets
    return len(stream.train_offsets) - 1, [np.asarray(stream.val[a:b]) for a, b in zip(ends[:-1], ends[1:])]


def reply_records(first: int, documents: list[np.ndarray], tokenizer: GLMTokenizer) -> list[dict]:
    """Each chat document's prompt (up to the <|assistant|> that opens the reply to its last user turn, as text) and
    the integer of its reference's last turn."""
    chat, records = ChatTokens(tokenizer), []
    for number, ids in enumerate(documents, start=first):
        start, last = reply_span(ids, chat)
        reply = tokenizer.decode(ids[last:-1].tolist())
        answer = extract_answer(reply)
        if answer is None:
            raise ValueError(f"document {number}: the reference reply {reply!r} has no final 'Answer: <integer>'")
        records.append({"document": number, "prompt": tokenizer.decode(ids[:start].tolist()), "answer": answer})
    return records


def choice_records(first: int, texts: list[str], seed: int) -> list[dict]:
    """Each generated arithmetic problem (`Question: What is a + b?...Answer: N`; other texts are skipped) as a
    question with four integer choices, in increasing order, and the index of the right one."""
    rng, records = random.Random(seed), []
    for number, text in enumerate(texts, start=first):
        match = _QUESTION.match(text)
        if match is None:
            continue
        a, b, answer = int(match[1]), int(match[3]), extract_answer(text)
        wrong = sorted({a + b, a - b, a * b, answer - 1, answer + 1, answer - 10, answer + 10} - {answer})
        choices = sorted([answer, *rng.sample(wrong, 3)])
        question, gold = f"{match[0]}\nAnswer:", choices.index(answer)
        records.append({"document": number, "question": question, "choices": [str(c) for c in choices], "gold": gold})
    return records


def _write_task(folder: Path, name: str, records: list[dict], config: dict) -> None:
    data = (folder / f"{name}.jsonl").resolve()
    data.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
    task = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(folder.resolve() / "cache")},
        "test_split": "test",
        **config,
        "metadata": {"version": 1.0},
    }
    write_task_yaml(folder / f"{name}.yaml", task)


def write_tasks(settings: DictConfig, folder: Path) -> list[str]:
    """Write the tasks of the dataset at settings.dataset into `folder`; return their names, the group last.
    Reads settings.val_fraction (domain_val_fraction by domain), ppl_documents, ppl_chars, max_gen_toks and seed (of
    the distractors)."""
    tokens_dir = Path(settings.dataset) / "tokens"
    if not prepared(settings.dataset):
        raise FileNotFoundError(
            f"eval.dataset={settings.dataset} is not a prepared dataset ({tokens_dir / 'shards.json'} not found): "
            f"prepare it with `python run.py task=prepare source=embedded`, or set eval.dataset"
        )
    tokenizer = GLMTokenizer.from_file(Path(settings.dataset) / "tokenizer.json")
    shares = settings.get("domain_val_fraction") or {}
    domains = {
        d: held_out(tokens_dir, d, shares.get(d, settings.val_fraction)) for d in read_index(tokens_dir)["domains"]
    }

    def texts(domain: str, count: int | None = None) -> tuple[int, list[str]]:
        first, documents = domains[domain]
        return first, [tokenizer.decode(ids[:-1].tolist()) for ids in documents[:count]]

    def generated(scorer: str, metrics: list[str], **options) -> dict:
        return {
            "output_type": "generate_until",
            "doc_to_text": "prompt",
            "doc_to_target": "answer",
            "generation_kwargs": {"until": list(STOP_TOKENS), "max_gen_toks": settings.max_gen_toks, "do_sample": False}
            | options,
            "process_results": Function(f"{__name__}.{scorer}"),
            "metric_list": [{"metric": metric, "aggregation": "mean", "higher_is_better": True} for metric in metrics],
        }

    tasks = {}  # name -> (records, task config)
    if "rl" in domains:
        tasks[f"{GROUP}_arithmetic"] = (
            reply_records(*domains["rl"], tokenizer),
            generated("score_arithmetic", ["exact_match"]),
        )
    if "style" in domains:
        records = reply_records(*domains["style"], tokenizer)
        tasks[f"{GROUP}_style"] = (
            [record | {"style": requested_style(record["prompt"])} for record in records],
            generated("score_style", ["follows_style", "exact_match"]),
        )
    if "tool" in domains:
        tasks[f"{GROUP}_tool_arithmetic"] = (
            reply_records(*domains["tool"], tokenizer),
            generated(
                "score_tool_arithmetic", ["exact_match", "tool_calls"], tools=["calculator"], max_turns=TOOL_TURNS
            ),
        )
    if "math" in domains:
        tasks[f"{GROUP}_arithmetic_mc"] = (
            choice_records(*texts("math"), settings.seed),
            {
                "output_type": "multiple_choice",
                "doc_to_text": "question",
                "doc_to_choice": "choices",
                "doc_to_target": "gold",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            },
        )
    for domain in domains:
        first, documents = texts(domain, settings.ppl_documents)
        records = [
            {"document": number, "text": text[: settings.ppl_chars]} for number, text in enumerate(documents, first)
        ]
        tasks[f"{GROUP}_ppl_{domain}"] = (
            records,
            {
                "output_type": "loglikelihood_rolling",
                "doc_to_text": "",
                "doc_to_target": "text",
                "metric_list": [
                    {"metric": metric, "aggregation": aggregation, "higher_is_better": False}
                    for metric, aggregation in PPL_METRICS.items()
                ],
            },
        )
    names = [name for name, (records, _) in tasks.items() if records]
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        _write_task(folder, name, *tasks[name])
    (folder / f"{GROUP}.yaml").write_text(yaml.safe_dump({"group": GROUP, "task": names}, sort_keys=False))
    return [*names, GROUP]
