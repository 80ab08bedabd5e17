"""`task=sample`: rejection sampling, as GLM-4.5 selects what its unified model is distilled from (arXiv:2508.06471,
section 3.1): each prompt's `n` candidates from a model, GLM's filters in order (glm46.sampling.filters), and the
best kept candidate of each prompt (or every kept one) written as chat JSONL that `source=chat` reads.

    python run.py task=sample sample.model=<run or export> sample.prompts=<prepared dir or JSONL> sample.n=8 \\
        sample.output=FILE
    sampled 400 prompts x 8: 3,200 candidates, 1,912 kept; wrote 371 conversations to FILE
      dropped: wrong_answer 1,020, truncated 180, ...

Beside FILE, FILE.manifest.json counts prompts, candidates, what was kept and written, each reason's drops
with examples (`candidates == kept + sum(dropped)` always), and the verifiable prompts by how many of their
candidates were right (`solved`). With `sample.pass_rate=[low, high]`, FILE.prompts.jsonl holds the verifiable
prompts, with their reference replies, whose share of right candidates lies within: GLM-4.5's difficulty filter for
RL's prompts, prepared with source=chat for data=rl. The report's two stages: moderate prompts first
(`pass_rate=[0.1, 0.9]`), then the hard ones, pass@8 = 0 and pass@512 > 0 (`n=512 fail_first_k=8
pass_rate=[0.001, 1]`). `sample.fail_first_k=k` keeps the prompts none of whose first k candidates is right: the
candidates are seeded by (seed, prompt, number), so the first k are what sampling k alone draws, and pass@k is
measured exactly, not estimated.

Over several tasks (`sample.tasks=T`), task t samples the prompt batches b with b % T == t into
FILE.parts/part-<t>-of-<T>.json; with `sample.task` unset the missing parts run here, sample.num_workers processes
at a time, and the parts are merged in prompt order: the file and manifest equal one process's. On Slurm, each part
is a job of an array (`-m 'sample.task=range(T)'`), and the same command without sample.task merges them.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from glm46.checkpoint import find_weights
from glm46.checkpoint.hf_read import load_hf
from glm46.data.tokenizer import GLMTokenizer
from glm46.logs import rank_zero_logger
from glm46.rl.reward_export import load_reward_model
from glm46.sampling.draw import DrawSettings, draw
from glm46.sampling.filters import REASONS, Candidate, best
from glm46.sampling.prompt_records import SamplePrompt, read_prompts

log = rank_zero_logger(__name__)
EXAMPLES = 3  # per reason in the manifest


def part_file(output: Path, task: int, tasks: int) -> Path:
    return output.parent / f"{output.name}.parts" / f"part-{task:05d}-of-{tasks:05d}.json"


def conversation(prompt: SamplePrompt, chosen: Candidate) -> dict:
    """A kept candidate as the chat JSONL record source=chat reads."""
    record = {"id": f"{prompt.id}#{chosen.number}", "domain": prompt.domain, "messages": chosen.messages}
    if prompt.tools:
        record["tools"] = prompt.tools
    return record | {"reward": chosen.reward, "score": chosen.score}


def prompt_record(prompt: SamplePrompt) -> dict:
    """A prompt with its reference reply, as the chat JSONL record that source=chat prepares for RL (data=rl)."""
    record = {"id": prompt.id, "domain": prompt.domain, "messages": prompt.messages + prompt.reference}
    return record | ({"tools": prompt.tools} if prompt.tools else {})


def judged(
    prompts: list[SamplePrompt],
    candidates: list[list[Candidate]],
    keep: str,
    pass_rate: list[float] | None = None,
    fail_first_k: int | None = None,
) -> dict:
    """The part's result: the records to write and the counts, as lists and dicts that merge by concatenation and
    sums (each record and example tagged with its prompt and candidate, for the merge's order). `solved` counts the
    verifiable prompts by how many of their candidates were right; with `pass_rate` [low, high], the verifiable
    prompts whose share of right candidates lies within (and, with `fail_first_k`, none of whose first k candidates is
    right) are `selected` (a difficulty filter for RL's prompts)."""
    records, dropped, examples = [], dict.fromkeys(REASONS, 0), {reason: [] for reason in REASONS}
    solved, selected = {}, []
    for prompt, drawn in zip(prompts, candidates):
        if prompt.answer is not None:
            right = sum(c.reward >= 1 for c in drawn)
            solved[str(right)] = solved.get(str(right), 0) + 1
            unsolved = not any(c.reward >= 1 for c in drawn[: fail_first_k or 0])  # pass@k = 0
            if pass_rate is not None and pass_rate[0] <= right / len(drawn) <= pass_rate[1] and unsolved:
                selected.append([prompt.index, 0, prompt_record(prompt)])
        for c in drawn:
            if c.reason is not None:
                dropped[c.reason] += 1
                if len(examples[c.reason]) < EXAMPLES:
                    examples[c.reason].append(
                        {"index": prompt.index, "prompt": prompt.id, "candidate": c.number, "text": c.text[-400:]}
                    )
        chosen = [best(drawn)] if keep == "best" else [c for c in drawn if c.reason is None]
        records += [[prompt.index, c.number, conversation(prompt, c)] for c in chosen if c is not None]
    kept = sum(c.reason is None for drawn in candidates for c in drawn)
    return {
        "prompts": len(prompts),
        "candidates": sum(map(len, candidates)),
        "kept": kept,
        "prompts_without_sample": sum(all(c.reason for c in drawn) for drawn in candidates),
        "dropped": dropped,
        "examples": examples,
        "solved": solved,
        "records": records,
        "selected": selected,
    }


def sample_part(settings: dict, seed: int, task: int) -> Path:
    """Task `task` of settings["tasks"]: its prompt batches drawn, judged and written to its part file."""
    if settings.get("threads"):
        torch.set_num_threads(settings["threads"])
    weights = find_weights(settings["model"])
    tokenizer = GLMTokenizer.from_file(weights / "tokenizer.json")
    prompts = read_prompts(settings["prompts"], tokenizer, settings["split"], settings["val_fraction"],
                           settings["domains"])[: settings["limit"]]  # fmt: skip
    draw_settings = DrawSettings(**{key: settings[key] for key in DrawSettings.__dataclass_fields__})
    filters = instantiate(settings["filters"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_hf(weights, device=device).eval()
    reward_model = load_reward_model(settings["reward_model"], device) if settings["reward_model"] else None
    size, tasks = draw_settings.batch_size, settings["tasks"]
    batches = [prompts[start : start + size] for start in range(0, len(prompts), size)][task::tasks]
    results = []
    for number, batch in enumerate(batches, start=1):
        candidates = draw(model, tokenizer, batch, draw_settings, filters, seed, reward_model)
        results.append(judged(batch, candidates, settings["keep"], settings["pass_rate"], settings["fail_first_k"]))
        kept = sum(r["kept"] for r in results)
        drawn = sum(r["candidates"] for r in results)
        log.info(f"task {task}/{tasks}: batch {number}/{len(batches)}, {kept} of {drawn} candidates kept")
    file = part_file(Path(settings["output"]), task, tasks)
    file.parent.mkdir(parents=True, exist_ok=True)
    temporary = file.with_suffix(".tmp")
    temporary.write_text(json.dumps(merged(results)))
    os.replace(temporary, file)  # a part exists only whole
    return file


def merged(results: list[dict]) -> dict:
    """Parts' (or batches') results as one, records and examples in prompt and candidate order."""
    total = {"prompts": 0, "candidates": 0, "kept": 0, "prompts_without_sample": 0}
    for key in total:
        total[key] = sum(r[key] for r in results)
    total["dropped"] = {reason: sum(r["dropped"][reason] for r in results) for reason in REASONS}
    total["examples"] = {
        reason: sorted((e for r in results for e in r["examples"][reason]), key=lambda e: (e["index"], e["candidate"]))[
            :EXAMPLES
        ]
        for reason in REASONS
    }
    total["solved"] = {}
    for result in results:
        for right, count in result["solved"].items():
            total["solved"][right] = total["solved"].get(right, 0) + count
    total["solved"] = dict(sorted(total["solved"].items(), key=lambda item: int(item[0])))
    for key in ("records", "selected"):
        total[key] = sorted((r for result in results for r in result[key]), key=lambda r: r[:2])
    return total


def run_sample(settings: DictConfig, seed: int) -> dict:
    """task=sample: the missing parts (here, or sample.num_workers processes at a time), then the merged output and
    its manifest; with sample.task set, that part alone."""
    plain = OmegaConf.to_container(settings, resolve=True)
    output, tasks = Path(plain["output"]), plain["tasks"]
    if plain["task"] is not None:
        return {"part": str(sample_part(plain, seed, plain["task"]))}
    missing = [t for t in range(tasks) if not part_file(output, t, tasks).is_file()]
    if len(missing) < tasks:
        log.info(f"{tasks - len(missing)} of {tasks} parts sampled before; sampling {len(missing)}")
    if plain["num_workers"] > 1 and len(missing) > 1:
        with ProcessPoolExecutor(min(plain["num_workers"], len(missing)), mp_context=get_context("spawn")) as pool:
            list(pool.map(sample_part, [plain] * len(missing), [seed] * len(missing), missing))
    else:
        for task in missing:
            sample_part(plain, seed, task)
    return write_output(plain, [json.loads(part_file(output, t, tasks).read_text()) for t in range(tasks)])


def emptiness(manifest_file: Path) -> str | None:
    """Why a sampling run's output is empty (no conversation written, or with pass_rate no prompt selected), naming
    its most frequent drop with an example; None when it holds something."""
    manifest = json.loads(Path(manifest_file).read_text())
    if manifest["written"] and manifest.get("selected_prompts") != 0:
        return None
    made = "no conversation" if not manifest["written"] else "no prompt within sample.pass_rate"
    reason, count = max(manifest["dropped"].items(), key=lambda item: item[1])
    if not count:
        return f"{made} from {manifest['prompts']:,} prompts ({manifest['candidates']:,} candidates, none dropped)"
    example = manifest["examples"][reason][0]
    return (
        f"{made}: {count:,} of {manifest['candidates']:,} candidates dropped as {reason}, e.g. prompt "
        f"{example['prompt']}, candidate {example['candidate']}: {example['text'][-200:]!r} ({manifest_file})"
    )


def write_output(settings: dict, parts: list[dict]) -> dict:
    result = merged(parts)
    output = Path(settings["output"])
    output.parent.mkdir(parents=True, exist_ok=True)
    records, selected = result.pop("records"), result.pop("selected")
    with open(output, "w") as file:
        file.writelines(json.dumps(record, ensure_ascii=False) + "\n" for _, _, record in records)
    result["written"] = len(records)
    if settings["pass_rate"] is not None:
        with open(f"{output}.prompts.jsonl", "w") as file:
            file.writelines(json.dumps(record, ensure_ascii=False) + "\n" for _, _, record in selected)
        result["selected_prompts"] = len(selected)
    manifest = {
        "output": str(output),
        **result,
        "settings": {
            key: settings[key]
            for key in ("model", "prompts", "n", "keep", "temperature", "reward_model", "pass_rate", "fail_first_k")
        },
        "filters": asdict(instantiate(settings["filters"])),
    }
    Path(f"{output}.manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    drops = ", ".join(f"{reason} {count:,}" for reason, count in result["dropped"].items() if count) or "none"
    print(
        f"sampled {result['prompts']:,} prompts x {settings['n']}: {result['candidates']:,} candidates, "
        f"{result['kept']:,} kept; wrote {result['written']:,} conversations to {output}\n  dropped: {drops}",
        flush=True,
    )
    if result["solved"]:
        counts = ", ".join(f"{right}: {count:,}" for right, count in result["solved"].items())
        print(f"  verifiable prompts by right candidates of {settings['n']}: {counts}", flush=True)
    if settings["pass_rate"] is not None:
        low, high = settings["pass_rate"]
        first = f", none of their first {settings['fail_first_k']} right" if settings["fail_first_k"] else ""
        print(
            f"  {len(selected):,} prompts right in {low:.0%}-{high:.0%} of their candidates{first}: "
            f"{output}.prompts.jsonl"
        )
    return manifest
