"""Near-duplicate detection throughput: our pipeline (bulk MinHash over worker processes + LSH) against
datasketch's naive per-shingle `MinHash.update` loop, end to end from a JSONL file.

    python bench/dedup_throughput.py --docs 20000 --workers 2
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from datasketch import MinHash, MinHashLSH

from glm46.data.dedup import dedup_near, shingles
from glm46.data.documents import Ledger
from glm46.data.sources import read_jsonl


def write_corpus(path: Path, docs: int, words: int = 200, seed: int = 0) -> None:
    rng = random.Random(seed)
    vocabulary = [f"w{i}" for i in range(5000)]
    with open(path, "w") as f:
        for i in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choices(vocabulary, k=words)), "id": i}) + "\n")


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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.jsonl"
        write_corpus(path, args.docs)
        results = {}
        for name, run in (("datasketch naive update loop", lambda: naive(path, args.num_perm, 0.8)),
                          (f"glm46 dedup_near ({args.workers} workers)",
                           lambda: ours(path, args.num_perm, 0.8, args.workers))):
            start = time.perf_counter()
            kept = run()
            results[name] = args.docs / (time.perf_counter() - start)
            print(f"{name:40s} {results[name]:9.0f} docs/s  (kept {kept} of {args.docs})")
        peer, mine = results.values()
        print(f"ratio: x{mine / peer:.2f}")


if __name__ == "__main__":
    main()
