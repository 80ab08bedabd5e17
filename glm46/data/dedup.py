"""Deduplication: exact (content hash), URL, and near-duplicate (MinHash + LSH with datasketch).

Every stage keeps the first document of a group in input order, so a run is deterministic, and
reports each removal to the ledger.
"""

from __future__ import annotations

import hashlib
import re
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from urllib.parse import urlsplit, urlunsplit

from datasketch import LeanMinHash, MinHash, MinHashLSH
from tqdm import tqdm

from .documents import Document, Ledger

_WORD = re.compile(r"\w+")


def dedup_exact(docs: list[Document], ledger: Ledger) -> list[Document]:
    seen, kept = set(), []
    for doc in docs:
        key = hashlib.blake2b(doc.text.encode("utf-8"), digest_size=16).digest()
        if key in seen:
            ledger.drop(doc, "exact_duplicate")
        else:
            seen.add(key)
            kept.append(doc)
    return kept


def normalize_url(url: str) -> str:
    parts = urlsplit(url.strip())
    return urlunsplit((parts.scheme.lower(), parts.netloc.lower(), parts.path.rstrip("/"), parts.query, ""))


def dedup_urls(docs: list[Document], ledger: Ledger) -> list[Document]:
    seen, kept = set(), []
    for doc in docs:
        if doc.url:
            key = normalize_url(doc.url)
            if key in seen:
                ledger.drop(doc, "url_duplicate")
                continue
            seen.add(key)
        kept.append(doc)
    return kept


def shingles(text: str, size: int) -> list[bytes]:
    """Lower-cased word n-grams; a text shorter than one n-gram is its own single shingle."""
    words = _WORD.findall(text.lower())
    if len(words) < size:
        return [" ".join(words).encode("utf-8")]
    return list({" ".join(words[i : i + size]).encode("utf-8") for i in range(len(words) - size + 1)})


def _signatures(texts: list[str], shingle_size: int, num_perm: int, seed: int) -> list[LeanMinHash]:
    return MinHash.bulk([shingles(text, shingle_size) for text in texts], num_perm=num_perm, seed=seed)


def minhash_signatures(texts: list[str], shingle_size: int, num_perm: int, seed: int = 1,
                       num_workers: int = 1, chunk: int = 2000) -> list[LeanMinHash]:
    """One MinHash per text, computed in chunks over num_workers processes."""
    work = partial(_signatures, shingle_size=shingle_size, num_perm=num_perm, seed=seed)
    chunks = [texts[i : i + chunk] for i in range(0, len(texts), chunk)]
    progress = dict(total=len(chunks), desc="minhash", unit="chunk", leave=False)
    if num_workers > 1 and len(chunks) > 1:
        with ProcessPoolExecutor(num_workers) as pool:
            parts = list(tqdm(pool.map(work, chunks), **progress))
    else:
        parts = [work(c) for c in tqdm(chunks, **progress)]
    return [minhash for part in parts for minhash in part]


def dedup_near(docs: list[Document], ledger: Ledger, threshold: float = 0.8, num_perm: int = 128,
               shingle_size: int = 5, seed: int = 1, num_workers: int = 1) -> list[Document]:
    """Drop a document whose estimated Jaccard similarity to an earlier kept one reaches threshold.

    The LSH bands lean towards recall (false negatives weigh 0.8), and every candidate is checked
    against the threshold with its MinHash estimate, so false positives are not dropped.
    """
    signatures = minhash_signatures([d.text for d in docs], shingle_size, num_perm, seed, num_workers)
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(0.2, 0.8))
    kept = []
    for index, (doc, minhash) in enumerate(tqdm(zip(docs, signatures), total=len(docs), desc="lsh", leave=False)):
        if any(minhash.jaccard(signatures[other]) >= threshold for other in lsh.query(minhash)):
            ledger.drop(doc, "near_duplicate")
        else:
            lsh.insert(index, minhash)
            kept.append(doc)
    return kept
