"""The tasks of a staged preparation (the stages are listed in glm46.data.staged): each reads the plan and the
folders of the stages before it and returns the files it wrote in its own folder plus its stats.

A document is named by its key (glm46.data.staged.work.KEY_BITS): the read task that read it and its position
there, so keys sort in input order. A stage's drops are sorted keys; the key sets never overlap (each stage looks
only at the documents the stages before it kept).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import numpy as np

from ..dedup import band_keys, content_key, lsh_bands, minhash_signatures, near_duplicates, normalize_url
from ..documents import Document, Ledger, excluded_record
from ..prepare import (
    READERS,
    document_line,
    normalize_document,
)
from ..quality import QualityRules, violation
from ..shards import encode_documents, load_tokenizer, token_dtype
from ..tokenizer import GLMTokenizer, train_tokenizer
from .assemble import finish, merge
from .classifier import quality_classifier, quality_model
from .excluded import write_excluded
from .perplexity import cutoffs as perplexity_cutoffs
from .perplexity import perplexity, perplexity_model, with_perplexity
from .semantic import embed, semantic_clusters, semantic_dedup
from .toxicity import toxicity
from .verdicts import domain_lines, dropped_keys, save_drops, stage_scores, verdicts
from .work import FILTER_REASONS, KEY_BITS, StagedPlan, write_task

MAX_EXAMPLES = Ledger.max_examples


class _Inputs(Ledger):
    """A Ledger that also keeps every input in order (an admitted Document, or a rejection's arguments), so that
    a source without files to split (the embedded corpus) can be cut into contiguous slices of its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list = []

    def admit(self, doc: Document) -> Document:
        self.inputs.append(doc)
        return super().admit(doc)

    def reject(self, reason: str, where: str, detail: str = "", nbytes: int = 0, count: int = 1) -> None:
        self.inputs.append((reason, where, detail, nbytes, count))
        super().reject(reason, where, detail, nbytes, count)


def _read_inputs(plan: StagedPlan, task: int) -> tuple[Ledger, list[tuple[int, Document]]]:
    """(this task's ledger, its documents with their positions): its files, or its slice of the embedded corpus."""
    everything = _Inputs()
    if plan.keep_excluded and plan.shards:
        everything.excluded = []
    documents = READERS[plan.reader](
        plan.shards[task] if plan.shards else [], everything, plan.default_domain, **plan.options
    )
    if plan.shards:
        return everything, [(len(everything.inputs) - 1, doc) for doc in documents]
    for _ in documents:
        pass
    count = len(everything.inputs)
    ledger, inputs = Ledger(excluded=[] if plan.keep_excluded else None), []
    for position, item in enumerate(everything.inputs[count * task // plan.tasks : count * (task + 1) // plan.tasks]):
        if isinstance(item, Document):
            inputs.append((position, ledger.admit(item)))
        else:
            ledger.reject(*item)
    return ledger, inputs


def _digests(keys: list[bytes]) -> np.ndarray:
    """16-byte digests as [n, 2] uint64."""
    return np.frombuffer(b"".join(keys), np.uint64).reshape(-1, 2) if keys else np.zeros((0, 2), np.uint64)


def _ledger_state(ledger: Ledger) -> dict:
    """The ledger's counts as JSON (dataclasses.asdict would rebuild its Counters from (key, count) pairs); its
    excluded records go to their own files."""
    return {
        f.name: dict(v) if isinstance(v := getattr(ledger, f.name), Counter) else v
        for f in fields(ledger)
        if f.name != "excluded"
    }


def read(plan: StagedPlan, task: int, folder: Path) -> dict:
    """Read, normalise, max_chars; per kept document its verdicts and keys; each key sent to its owner task."""
    ledger, inputs = _read_inputs(plan, task)
    rules, dedup = QualityRules(**plan.quality), plan.dedup
    kept, keys, normalised_bytes = [], [], 0
    for position, doc in inputs:
        if not normalize_document(doc, ledger):
            continue
        normalised_bytes += doc.nbytes
        if len(doc.text) > rules.max_chars:  # before deduplication, as in one process: no MinHash for it
            ledger.drop(doc, "quality/max_chars")
            continue
        kept.append(doc)
        keys.append(task << KEY_BITS | position)
    keys = np.array(keys, np.int64)
    domains = sorted({doc.domain for doc in kept})
    rules_broken = [violation(doc, rules) or "" for doc in kept]
    rule_names = sorted(set(rules_broken) - {""})
    np.savez(
        folder / "meta.npz",
        keys=keys,
        domain=np.array([domains.index(doc.domain) for doc in kept], np.int32),
        nbytes=np.array([doc.nbytes for doc in kept], np.int64),
        quality=np.array([rule_names.index(r) + 1 if r else 0 for r in rules_broken], np.int32),
    )
    if plan.keep_excluded:
        write_excluded(folder, ledger.excluded)
    (folder / "docs").mkdir()
    for domain in domains:
        with open(folder / "docs" / f"{domain}.jsonl", "w") as f:
            f.writelines(document_line(doc) for doc in kept if doc.domain == domain)

    exact = _digests([content_key(doc.text if doc.key is None else doc.key) for doc in kept])
    with_url = np.array([doc.url is not None for doc in kept], bool)
    url = _digests([content_key(normalize_url(doc.url)) for doc in kept if doc.url])
    if dedup.get("near", True):
        signatures = minhash_signatures(
            [doc.text for doc in kept], dedup["shingle_size"], dedup["num_perm"], dedup["seed"], plan.threads
        )
        np.save(folder / "signatures.npy", signatures)
        bands = band_keys(signatures, lsh_bands(dedup["threshold"], dedup["num_perm"]))  # [documents, bands]
    else:
        bands = np.zeros((len(kept), 0), np.uint64)
    owners = np.uint64(plan.tasks)
    band_id = np.broadcast_to(np.arange(bands.shape[1], dtype=np.int32), bands.shape)
    band_doc = np.broadcast_to(keys[:, None], bands.shape)
    for owner in range(plan.tasks):
        mine_exact, mine_url = exact[:, 0] % owners == owner, url[:, 0] % owners == owner
        mine_band = bands % owners == owner
        np.savez(
            folder / f"part-{owner}.npz",
            exact_doc=keys[mine_exact],
            exact_hash=exact[mine_exact],
            url_doc=keys[with_url][mine_url],
            url_hash=url[mine_url],
            band_doc=band_doc[mine_band],
            band_id=band_id[mine_band],
            band_hash=bands[mine_band],
        )
    return {
        "documents": len(inputs),
        "bytes": ledger.bytes_in,
        "kept": len(kept),
        "normalised": [len(kept) + ledger.dropped["quality/max_chars"], normalised_bytes],
        "domains": domains,
        "quality_rules": rule_names,
        "ledger": _ledger_state(ledger),
    }


def _parts(plan: StagedPlan, owner: int, *names: str) -> list[np.ndarray]:
    """The rows every read task sent to `owner`, per array name."""
    parts = [np.load(plan.task_dir("read", t) / f"part-{owner}.npz") for t in range(plan.tasks)]
    return [np.concatenate([part[name] for part in parts]) for name in names]


def _later_copies(docs: np.ndarray, *columns: np.ndarray) -> np.ndarray:
    """Sorted keys of the documents whose value (the columns) an earlier document in input order has."""
    order = np.lexsort((docs, *reversed(columns)))
    values = np.stack([c[order] for c in columns], axis=1)
    repeat = np.all(values[1:] == values[:-1], axis=1)
    return np.sort(docs[order][1:][repeat])


def exact(plan: StagedPlan, owner: int, folder: Path) -> dict:
    docs, digests = _parts(plan, owner, "exact_doc", "exact_hash")
    return save_drops(folder, _later_copies(docs, digests[:, 0], digests[:, 1]), len(docs))


def url(plan: StagedPlan, owner: int, folder: Path) -> dict:
    docs, digests = _parts(plan, owner, "url_doc", "url_hash")
    alive = ~np.isin(docs, dropped_keys(plan, ["exact"]))
    return save_drops(folder, _later_copies(docs[alive], digests[alive, 0], digests[alive, 1]), int(alive.sum()))


def bands(plan: StagedPlan, owner: int, folder: Path) -> dict:
    """Edges (first document of a bucket, another of it) of the owned LSH buckets holding two or more documents."""
    docs, band, value = _parts(plan, owner, "band_doc", "band_id", "band_hash")
    alive = ~np.isin(docs, dropped_keys(plan, ["exact", "url"]))
    docs, band, value = docs[alive], band[alive], value[alive]
    order = np.lexsort((docs, value, band))
    docs, band, value = docs[order], band[order], value[order]
    same = np.zeros(len(docs), bool)
    same[1:] = (band[1:] == band[:-1]) & (value[1:] == value[:-1])
    first = np.maximum.accumulate(np.where(same, 0, np.arange(len(docs))))
    np.save(folder / "edges.npy", np.stack([docs[first[same]], docs[same]], axis=1).reshape(-1, 2))
    return {"documents": int(alive.sum()), "edges": int(same.sum())}


def clusters(plan: StagedPlan, index: int, folder: Path) -> dict:
    """Connected components of all edges (every near-duplicate decision stays within one), dealt over the tasks."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    edges = np.concatenate([np.load(plan.task_dir("bands", i) / "edges.npy") for i in range(plan.tasks)])
    candidates = np.unique(edges)
    ends = np.searchsorted(candidates, edges)
    graph = coo_matrix((np.ones(len(ends), np.int8), (ends[:, 0], ends[:, 1])), shape=(len(candidates),) * 2)
    count, labels = connected_components(graph, directed=False)
    np.savez(folder / "groups.npz", candidates=candidates, group=labels % plan.tasks)
    return {"documents": len(candidates), "components": int(count)}


def near(plan: StagedPlan, group: int, folder: Path) -> dict:
    """MinHashLSH's keep-first loop over this group's components, in input order (keys sort so)."""
    groups = np.load(plan.task_dir("clusters", 0) / "groups.npz")
    candidates = groups["candidates"][groups["group"] == group]
    readers = candidates >> KEY_BITS
    signatures = []
    for reader in np.unique(readers):
        keys = np.load(plan.task_dir("read", int(reader)) / "meta.npz")["keys"]
        rows = np.searchsorted(keys, candidates[readers == reader])
        signatures.append(np.load(plan.task_dir("read", int(reader)) / "signatures.npy", mmap_mode="r")[rows])
    signatures = np.concatenate(signatures) if signatures else np.zeros((0, plan.dedup["num_perm"]), np.uint32)
    bands_ = lsh_bands(plan.dedup["threshold"], plan.dedup["num_perm"])
    dropped = near_duplicates(signatures, np.arange(len(candidates)), bands_, plan.dedup["threshold"])
    return save_drops(folder, candidates[sorted(dropped)], len(candidates))


def _kept_texts(plan: StagedPlan):
    """The kept documents' texts in the one-process order: domains sorted, then input order."""
    judged = [verdicts(plan, reader) for reader in range(plan.tasks)]
    domains = sorted({d for reader in range(plan.tasks) for d in plan.stats("read", reader)["domains"]})
    for domain in domains:
        for reader, (meta, verdict) in enumerate(judged):
            rows, lines = domain_lines(plan, reader, meta, domain)
            yield from (json.loads(line)["text"] for row, line in zip(rows, lines) if not verdict[row])


def tokenizer(plan: StagedPlan, index: int, folder: Path) -> dict:
    """The given tokenizer (checked), or a BPE trained on the kept documents in the one-process order (streamed,
    as one process streams them)."""
    if plan.tokenizer_path:
        load_tokenizer(plan.tokenizer_path).save(folder / "tokenizer.json")
        return {"documents": 0}
    read = {"documents": 0, "bytes": 0}

    def texts():
        for text in _kept_texts(plan):
            read["documents"] += 1
            read["bytes"] += len(text.encode())
            yield text

    GLMTokenizer(train_tokenizer(texts(), plan.vocab_size, max_digits=plan.max_digits)).save(folder / "tokenizer.json")
    return read


def tokenize(plan: StagedPlan, reader: int, folder: Path) -> dict:
    """A read task's kept documents -> per domain, their document lines and tokens; what was dropped and why."""
    tokenizer_ = GLMTokenizer.from_file(plan.task_dir("tokenizer", 0) / "tokenizer.json")
    dtype = token_dtype(tokenizer_)
    meta, verdict = verdicts(plan, reader)
    scores = {FILTER_REASONS[stage]: stage_scores(plan, stage, reader) for stage in FILTER_REASONS}
    perplexities, cutoffs = scores["perplexity"], perplexity_cutoffs(plan)
    domains, dropped = {}, {}
    for domain in plan.stats("read", reader)["domains"]:
        rows, lines = domain_lines(plan, reader, meta, domain)
        keys = meta["keys"][rows].tolist()
        kept = [
            with_perplexity(line, perplexities.get(key), cutoffs)
            for row, key, line in zip(rows, keys, lines)
            if not verdict[row]
        ]
        for row, line in zip(rows, lines):
            if verdict[row]:
                dropped.setdefault(verdict[row], []).append((int(meta["keys"][row]), int(meta["nbytes"][row]), line))
        if not kept:
            continue
        (folder / f"{domain}.jsonl").write_text("".join(kept))
        tokens, offsets = encode_documents(
            [json.loads(line)["text"] for line in kept], tokenizer_, num_threads=plan.threads
        )
        tokens.astype(dtype, copy=False).tofile(folder / f"{domain}.bin")
        np.save(folder / f"{domain}.idx.npy", offsets)
        kept_bytes = int(meta["nbytes"][rows][verdict[rows] == ""].sum())
        line_bytes = (folder / f"{domain}.jsonl").stat().st_size
        domains[domain] = {
            "documents": len(kept),
            "bytes": kept_bytes,
            "tokens": int(len(tokens)),
            "line_bytes": line_bytes,
        }
    reasons, excluded = {}, []
    for reason, items in dropped.items():
        items.sort()
        if plan.keep_excluded:
            scored = scores.get(reason, {})
            excluded += [
                excluded_record(reason, d["source"], d["text"], id=d["id"] or None, score=scored.get(key))
                for key, d in ((key, json.loads(line)) for key, _, line in items)
            ]
        examples = [json.loads(line)["source"] for _, _, line in items[:MAX_EXAMPLES]]
        reasons[reason] = {"count": len(items), "bytes": sum(b for _, b, _ in items), "examples": examples}
    write_excluded(folder, excluded)
    return {
        "documents": sum(d["documents"] for d in domains.values()),
        "bytes": sum(d["bytes"] for d in domains.values()),
        "domains": domains,
        "dropped": reasons,
    }


STAGES = {
    "read": read,
    "exact": exact,
    "url": url,
    "bands": bands,
    "clusters": clusters,
    "near": near,
    "perplexity_model": perplexity_model,
    "perplexity": perplexity,
    "quality_model": quality_model,
    "quality_classifier": quality_classifier,
    "toxicity": toxicity,
    "semantic_clusters": semantic_clusters,
    "embed": embed,
    "semantic_dedup": semantic_dedup,
    "tokenizer": tokenizer,
    "tokenize": tokenize,
    "merge": merge,
    "finish": finish,
}


def run_task(output_dir: str, stage: str, index: int, say: Callable[[str], None] = print) -> dict:
    """One task of one stage (what a Slurm array task or a local worker runs); a finished task is not run again.
    `say`: where its start and end lines go (its log, for a task of its own)."""
    plan = StagedPlan.load(output_dir)
    if plan.done(stage, index):
        return plan.stats(stage, index)
    started = time.perf_counter()
    say(f"prepare: stage {stage} task {index + 1}/{plan.size(stage)} started")

    def work(folder: Path) -> dict:
        return STAGES[stage](plan, index, folder) | {"seconds": round(time.perf_counter() - started, 3)}

    stats = write_task(plan, stage, index, work)
    say(f"prepare: stage {stage} task {index + 1}/{plan.size(stage)} done in {stats['seconds']:.1f} s")
    return stats
