"""What the stages decided about each document, as the later stages read it: the keys a stage dropped (each task's
`drops.npy`, sorted) and, per read task, each document's verdict ("" while kept, else its reason)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from .work import DROP_REASONS, KEY_BITS, StagedPlan


def dropped_keys(plan: StagedPlan, stages: list[str], reader: int | None = None) -> np.ndarray:
    """Sorted keys dropped by `stages` (those of the plan), all or only those of one read task's documents."""
    found = []
    for stage in (s for s in stages if s in plan.stages):
        for index in range(plan.size(stage)):
            keys = np.load(plan.task_dir(stage, index) / "drops.npy", mmap_mode="r")
            if reader is not None:
                keys = keys[np.searchsorted(keys, reader << KEY_BITS) : np.searchsorted(keys, (reader + 1) << KEY_BITS)]
            found.append(np.asarray(keys))
    return np.sort(np.concatenate(found)) if found else np.zeros(0, np.int64)


def save_drops(folder: Path, drops: np.ndarray, examined: int) -> dict:
    np.save(folder / "drops.npy", drops.astype(np.int64))
    return {"documents": examined, "dropped": len(drops)}


def verdicts(plan: StagedPlan, reader: int, before: str | None = None) -> tuple[dict, np.ndarray]:
    """(read task's meta, per document "" when kept, else the reason it is dropped), by the stages of the plan that
    come before `before` (all of them by default). Deduplication judges documents the quality rules failed too (its
    reason is the one kept); each model-based filter judges only the documents kept before it."""
    meta, stats = dict(np.load(plan.task_dir("read", reader) / "meta.npz")), plan.stats("read", reader)
    verdict = np.array([""] + [f"quality/{rule}" for rule in stats["quality_rules"]], object)[meta["quality"]]
    stages = plan.stages[: plan.stages.index(before)] if before else plan.stages
    for stage in (s for s in stages if s in DROP_REASONS):
        verdict[np.isin(meta["keys"], dropped_keys(plan, [stage], reader))] = DROP_REASONS[stage]
    return meta, verdict


def domain_lines(plan: StagedPlan, reader: int, meta: dict, domain: str) -> tuple[np.ndarray, list[str]]:
    """(a domain's rows in the read task's order, their document lines); none where the task read no such domain."""
    domains = plan.stats("read", reader)["domains"]
    if domain not in domains:
        return np.zeros(0, np.int64), []
    with open(plan.task_dir("read", reader) / "docs" / f"{domain}.jsonl") as f:
        return np.flatnonzero(meta["domain"] == domains.index(domain)), f.readlines()


def kept_documents(plan: StagedPlan, reader: int, domains: list[str], before: str) -> list[tuple[int, str]]:
    """(key, text) of a read task's documents of `domains` kept by the stages before `before`, in input order."""
    meta, verdict = verdicts(plan, reader, before)
    found = []
    for domain in domains:
        rows, lines = domain_lines(plan, reader, meta, domain)
        keys = meta["keys"][rows].tolist()
        found += [(key, json.loads(line)["text"]) for r, key, line in zip(rows, keys, lines) if not verdict[r]]
    return sorted(found)


def kept_texts(plan: StagedPlan, domains: list[str], before: str) -> Iterator[str]:
    """The texts of every read task's documents of `domains` kept by the stages before `before`, in input order
    (read task by task: a caller that takes the first n reads no further)."""
    for reader in range(plan.tasks):
        yield from (text for _, text in kept_documents(plan, reader, domains, before))


def judge(
    plan: StagedPlan,
    reader: int,
    folder: Path,
    stage: str,
    domains: list[str],
    score: Callable[[list[str]], list[float]],
    drop: Callable[[np.ndarray], np.ndarray] | None,
) -> dict:
    """A model-based filter's task for one read task: the documents of `domains` kept before `stage`, scored by
    `score(texts)`, those where `drop(scores)` holds dropped (none without a rule); their keys and scores saved
    (scores.npz) for the lines that carry them."""
    found = kept_documents(plan, reader, list(domains), stage)
    keys = np.array([key for key, _ in found], np.int64)
    values = np.asarray(score([text for _, text in found]), np.float64).reshape(-1)
    np.savez(folder / "scores.npz", keys=keys, scores=values)
    return save_drops(folder, keys[drop(values)] if drop is not None else keys[:0], len(keys))


def stage_scores(plan: StagedPlan, stage: str, reader: int) -> dict[int, float]:
    """key -> score of a read task's documents that filter `stage` scored (in whichever of its tasks); empty where
    the plan has no such stage."""
    if stage not in plan.stages:
        return {}
    first, last = reader << KEY_BITS, (reader + 1) << KEY_BITS
    found = {}
    for index in range(plan.size(stage)):
        scored = np.load(plan.task_dir(stage, index) / "scores.npz")
        mine = (scored["keys"] >= first) & (scored["keys"] < last)
        found |= dict(zip(scored["keys"][mine].tolist(), scored["scores"][mine].tolist()))
    return found
