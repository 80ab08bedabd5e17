"""Near-duplicate detection throughput: our pipeline (vectorised MinHash over worker processes + LSH
banding) against datasketch's naive per-shingle `MinHash.update` loop + `MinHashLSH`, end to end from a
JSONL file in which a tenth of the documents are near-duplicates (3 words of an earlier one changed).

The two alternate `--repeats` times and the best of each is reported, as the machine may be shared;
docs per CPU-second (all threads of the process) tell how much of that is other load.

    python bench/dedup_throughput.py --docs 20000 --workers 2
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from datasketch import MinHash, MinHashLSH
from timing import timed

from glm46.data.dedup import dedup_near, shingles
from glm46.data.documents import Ledger
from glm46.data.sources import read_jsonl


def write_corpus(path: Path, docs: int, words: int = 200, near_duplicates: float = 0.1, seed: int = 0) -> None:
    """Random documents over 5,000 words; a `near_duplicates` fraction copies an earlier one, 3 words changed."""
    rng = random.Random(seed)
    vocabulary = [f"w{i}" for i in range(5000)]
    texts = []
    for _ in range(docs):
        if texts and rng.random() < near_duplicates:
            copy = rng.choice(texts).split()
            for _ in range(3):
                copy[rng.randrange(len(copy))] = rng.choice(vocabulary)
            texts.append(" ".join(copy))
        else:
            texts.append(" ".join(rng.choices(vocabulary, k=words)))
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": text, "id": i}) + "\n" for i, text in enumerate(texts))


def naive(path: Path, num_perm: int, threshold: float) -> int:
    """The peer: read, then one `update` call per shingle, then LSH."""
    lsh, kept = MinHashLSH(threshold=threshold, num_perm=num_perm), 0
    for i, doc in enumerate(read_jsonl([str(path)], Ledger())):
        minhash = MinHash(num_perm=num_perm)
        for shingle in shingles(doc.text, 5):
            minhash.update(shingle)
        if not lsh.query(minhash):
            lsh.insert(i, minhash)
            kept += 1
    return kept


def ours(path: Path, num_perm: int, threshold: float, workers: int) -> int:
    ledger = Ledger()
    return len(dedup_near(list(read_jsonl([str(path)], ledger)), ledger, threshold, num_perm, num_workers=workers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--num-perm", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.jsonl"
        write_corpus(path, args.docs)
        runs = {
            "datasketch naive update loop": lambda: naive(path, args.num_perm, 0.8),
            f"glm46 dedup_near ({args.workers} workers)": lambda: ours(path, args.num_perm, 0.8, args.workers),
        }
        best = {name: [0.0, 0.0] for name in runs}
        for repeat in range(args.repeats):
            for name, run in runs.items():
                kept, wall, cpu = timed(run)
                rate, cpu_rate = args.docs / wall, args.docs / cpu
                best[name] = [max(best[name][0], rate), max(best[name][1], cpu_rate)]
                print(
                    f"run {repeat + 1}: {name:40s} {rate:9.0f} docs/s  {cpu_rate:9.0f} docs/CPU-s"
                    f"  (kept {kept} of {args.docs})"
                )
        for name, (rate, cpu_rate) in best.items():
            print(f"best: {name:40s} {rate:9.0f} docs/s  {cpu_rate:9.0f} docs/CPU-s")
        (peer, peer_cpu), (mine, mine_cpu) = best.values()
        print(f"ratio: x{mine / peer:.2f} (per CPU-second x{mine_cpu / peer_cpu:.2f})")


if __name__ == "__main__":
    main()
