"""What each filter of the preparation catches, and how fast: planted documents (bench/planted_docs.py) through
`prepare_dataset` with MinHash and the four model-based filters on, in the order they run; per stage its drops,
their precision (planted defects among them), its recall on what it exists to catch (of what reached it, and of
all planted), and documents per second of its scoring tasks, MinHash's row beside them.

    python bench/data_filters.py [--json out.json]

The corpus (ids name the kinds): reference prose (domain docs: the perplexity model's and the classifier's
reference), and in domain general: clean prose with a paraphrase of half of it later in input order (filler words
every 4 words, or its sentences reordered), gibberish, word salad, web boilerplate, long prose with one insult
inside, and prose with systems programming's violent verbs (a hard negative of toxicity). The filters' settings
are those of tests/ (printed with the table).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from collections import Counter
from pathlib import Path

from planted_docs import OFFENSIVE, TECHNICAL, gibberish, paragraphs, reordered, salad, spam, with_fillers

from glm46.data.pipeline import DEDUP_DEFAULTS
from glm46.data.quality import QualityRules
from glm46.data.staged.executors import run_local
from glm46.data.staged.work import plan_for

PERPLEXITY = {"reference_domains": ["docs"], "model": None, "order": 3, "domains": ["general"], "max": 3000.0}
CLASSIFIER = {"reference_domains": ["docs"], "model": None, "domains": ["general"], "min_score": 0.25, "folds": 2}
FASTTEXT = {"lr": 1.0, "dim": 100, "ws": 5, "epoch": 10, "minCount": 1, "wordNgrams": 2, "bucket": 100000}
SEMANTIC = {"threshold": 0.9, "domains": ["general"], "clusters": 4, "fit_sample": 10000, "max_tokens": 256}
FILTERS = {
    "perplexity": PERPLEXITY | {"buckets": [0.33, 0.66], "bucket_sample": 10000},
    "quality_classifier": CLASSIFIER | {"max_documents": 200000, "seed": 0, "hyperparameters": FASTTEXT},
    "toxicity": {"max": 0.9, "domains": ["general"]},
    "semantic_dedup": SEMANTIC | {"seed": 0},
}
# stage (its reason in the excluded files) -> the kinds it exists to catch, and the stages its time is the sum of
# (the first: the documents it examined); MinHash's signatures are computed as the documents are read
TARGETS = {
    "near_duplicate": ({"fillers", "reordered"}, ["read", "bands", "clusters", "near"]),
    "perplexity": ({"gibberish", "salad"}, ["perplexity", "perplexity_model"]),
    "quality_classifier": ({"spam"}, ["quality_classifier", "quality_model"]),
    "toxicity": ({"toxic"}, ["toxicity"]),
    "semantic_duplicate": ({"fillers", "reordered"}, ["embed", "semantic_clusters", "semantic_dedup"]),
}
DEFECTS = {"fillers", "reordered", "gibberish", "salad", "spam", "toxic"}


def planted(folder: Path, seed: int = 0) -> Counter:
    """Write the corpus as JSONL; return the count of each kind."""
    rng, found = random.Random(seed), paragraphs()
    reference, clean, sources = found[:225], found[225:305], found[305:]
    records = [{"text": text, "id": f"reference-{i}", "domain": "docs"} for i, text in enumerate(reference)]
    records += [{"text": text, "id": f"clean-{i}"} for i, text in enumerate(clean)]
    defects = [("gibberish", gibberish(t, rng)) for t in sources[:30]] + [
        ("salad", salad(t, rng)) for t in sources[30:60]
    ]
    defects += [("spam", spam(rng)) for _ in range(30)]
    defects += [("toxic", f"{t[: len(t) // 2]}\n{rng.choice(OFFENSIVE)}\n{t[len(t) // 2 :]}") for t in sources[60:90]]
    defects += [("technical", f"{t}\n{rng.choice(TECHNICAL)}") for t in sources[90:120]]
    rng.shuffle(defects)
    records += [{"text": text, "id": f"{kind}-{i}"} for i, (kind, text) in enumerate(defects)]
    records += [{"text": with_fillers(t, rng), "id": f"fillers-{i}"} for i, t in enumerate(clean[:20])]
    records += [{"text": reordered(t, rng), "id": f"reordered-{i}"} for i, t in enumerate(clean[20:40])]
    (folder / "planted.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return Counter(r["id"].rsplit("-", 1)[0] for r in records)


def kind(identifier: str) -> str:
    return identifier.rsplit("-", 1)[0]


def prepare(work: Path, name: str, filters: dict) -> tuple[dict[str, list[str]], object]:
    """The planted corpus prepared with `filters` (and MinHash, the quality rules) as prepare_dataset does, its stage
    stats kept; per reason, the kinds of what it dropped."""
    source = {"reader": "jsonl", "paths": [str(work / "planted.jsonl")], "output_dir": str(work / name)}
    settings = {"tasks": 1, "dedup": DEDUP_DEFAULTS, "quality": vars(QualityRules()), "keep_excluded": True}
    settings |= {"tokenizer": {"path": None, "vocab_size": 600, "max_digits": 3}} | filters
    plan = plan_for(source | {"default_domain": "general"}, settings)
    plan.save()
    run_local(plan, workers=1)
    excluded = work / name / "excluded"
    dropped = {f.stem: [kind(json.loads(line)["id"]) for line in f.open()] for f in excluded.glob("*.jsonl")}
    dropped["quality"] = [kind(json.loads(line)["id"]) for f in excluded.glob("quality/*.jsonl") for line in f.open()]
    return dropped, plan


def rows(kinds: Counter, dropped: dict[str, list[str]], plan, reasons: list[str]) -> dict[str, dict]:
    """Per reason (in the order its stages ran): its precision, recall and speed."""
    reached, found = Counter(kinds), {}
    for earlier in ("exact_duplicate", "url_duplicate", "quality"):
        reached.subtract(dropped.get(earlier, []))
    for reason in reasons:
        targets, stages = TARGETS[reason]
        these = Counter(dropped.get(reason, []))
        caught, seconds = sum(these[k] for k in targets), sum(plan.stats(stage, 0)["seconds"] for stage in stages)
        found[reason] = {
            "dropped": sum(these.values()),
            "kinds": dict(these),
            "precision": sum(these[k] for k in DEFECTS) / max(1, sum(these.values())),
            "recall_reached": caught / max(1, sum(reached[k] for k in targets)),
            "recall_planted": caught / sum(kinds[k] for k in targets),
            "hard_negatives_dropped": these["technical"] + these["clean"] + these["reference"],
            "documents_per_second": plan.stats(stages[0], 0)["documents"] / seconds,
        }
        reached.subtract(these)
    return found


def measure(work: Path) -> dict:
    kinds, result = planted(work), {"alone": {}}
    for name, settings in FILTERS.items():  # each filter alone after MinHash and the rules
        dropped, plan = prepare(work, name, {name: settings})
        reason = next(r for r in TARGETS if r != "near_duplicate" and TARGETS[r][1][0] in plan.stages)
        result["alone"] |= rows(kinds, dropped, plan, ["near_duplicate", reason])
    dropped, plan = prepare(work, "all", FILTERS)
    result["pipeline"] = rows(kinds, dropped, plan, list(TARGETS))
    duplicates = {"fillers", "reordered"}
    both = [k for r in ("near_duplicate", "semantic_duplicate") for k in dropped.get(r, []) if k in duplicates]
    result["paraphrases_found"] = len(both) / sum(kinds[k] for k in duplicates)
    result["kinds"] = dict(kinds)
    return result


def table(found: dict[str, dict]) -> str:
    lines = [
        f"{'stage':<20} {'dropped':>8} {'precision':>10} {'recall (reached)':>17} {'recall (planted)':>17} "
        f"{'hard neg. dropped':>18} {'docs/s':>9}"
    ]
    for reason, row in found.items():
        lines.append(
            f"{reason:<20} {row['dropped']:>8} {row['precision']:>10.2f} {row['recall_reached']:>17.2f} "
            f"{row['recall_planted']:>17.2f} {row['hard_negatives_dropped']:>18} {row['documents_per_second']:>9,.0f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        result = measure(Path(work))
    print(f"planted: {result['kinds']}")
    print(f"settings: {json.dumps(FILTERS)}")
    print("each filter alone, after exact/URL/MinHash dedup and the quality rules:")
    print(table(result["alone"]))
    print("all four on, in the order they run:")
    print(table(result["pipeline"]))
    print(f"paraphrases found by MinHash and semantic dedup together: {result['paraphrases_found']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
