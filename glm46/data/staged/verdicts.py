"""What the stages decided about each document, as the later stages read it: the keys a stage dropped (each task's
`drops.npy`, sorted) and, per read task, each document's verdict ("" while kept, else its reason)."""

from __future__ import annotations

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
