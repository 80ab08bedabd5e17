"""Deduplication: exact (content hash), URL, and near-duplicate (MinHash + LSH banding).

Every stage keeps the first document of a group in input order, so a run is deterministic, and
reports each removal to the ledger.

Near-duplicate signatures are the hash values of datasketch's `MinHash(num_perm, seed)` ("affine32"
permutations) with a 64-bit word-polynomial shingle hash in place of sha1 (tested): every shingle of a
chunk of documents is hashed and permuted by whole-array numpy operations instead of one sha1 and one
numpy call per shingle. Banding and the keep-first check are `MinHashLSH`'s (tested), run in Python
only for the documents that share a band with another one.
"""

from __future__ import annotations

import hashlib
import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from urllib.parse import urlsplit, urlunsplit

import numpy as np
from datasketch import MinHashLSH

from .documents import Document, Ledger
from .loop_progress import progress

_WORD = re.compile(r"\w+")


def content_key(text: str) -> bytes:
    """What exact deduplication compares: a 128-bit digest of the (normalised) text."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def normalize_url(url: str) -> str:
    parts = urlsplit(url.strip())
    return urlunsplit((parts.scheme.lower(), parts.netloc.lower(), parts.path.rstrip("/"), parts.query, ""))


def shingles(text: str, size: int) -> list[bytes]:
    """Lower-cased word n-grams; a text shorter than one n-gram is its own single shingle.

    The definition the signatures implement (the tests and the benchmark's peer use it directly).
    """
    words = _WORD.findall(text.lower())
    if len(words) < size:
        return [" ".join(words).encode("utf-8")]
    return list({" ".join(words[i : i + size]).encode("utf-8") for i in range(len(words) - size + 1)})


# ASCII byte -> itself lower-cased if the regex takes it as a word character, else a space.
_ASCII_WORDS = bytes(ord(chr(c).lower()) if c < 128 and _WORD.fullmatch(chr(c)) else 32 for c in range(256))
_BYTE_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd, so its powers are invertible modulo 2^64
_WORD_BASE = np.uint64(0xC2B2AE3D27D4EB4F)
_FMIX = {
    np.uint32: (16, 0x85EBCA6B, 13, 0xC2B2AE35, 16),
    np.uint64: (33, 0xFF51AFD7ED558CCD, 33, 0xC4CEB9FE1A85EC53, 33),
}


def _word_bytes(text: str) -> bytes:
    """The text's lower-cased words separated by spaces: one C-level translate for ASCII text."""
    if text.isascii():
        return text.encode().translate(_ASCII_WORDS)
    return " ".join(_WORD.findall(text.lower())).encode("utf-8")


def _fmix(values: np.ndarray) -> np.ndarray:
    """MurmurHash3's finalizer over uint32 or uint64 values (datasketch pre-mixes with the 32-bit one)."""
    s1, m1, s2, m2, s3 = (values.dtype.type(c) for c in _FMIX[values.dtype.type])
    values = (values ^ (values >> s1)) * m1
    values = (values ^ (values >> s2)) * m2
    return values ^ (values >> s3)


def _word_hashes(buffer: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(hash, start offset) of every word of a space-separated buffer that starts and ends with a space.

    A word hashes to fmix64(sum of byte_t * B^t mod 2^64), read off prefix sums of byte * B^offset so
    that no Python code runs per word: a difference of two prefix sums is the hash times B^start,
    which B^(n - start) * B^-n removes. One array holds the powers, then the terms, then the sums.
    """
    data = np.frombuffer(buffer, np.uint8)
    is_word = data != 32
    edges = np.flatnonzero(is_word[1:] != is_word[:-1]) + 1  # word starts and ends alternate
    starts, ends = edges[0::2], edges[1::2]
    sums = np.full(len(data), _BYTE_BASE)
    sums[0] = 1
    np.cumprod(sums, out=sums)
    unscale = sums[len(data) - starts] * np.uint64(pow(int(_BYTE_BASE), -len(data), 1 << 64))
    sums *= data
    np.cumsum(sums, out=sums)
    return _fmix((sums[ends - 1] - sums[starts - 1]) * unscale), starts


def _shingle_hashes(words: np.ndarray, offsets: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """32-bit hash of every word n-gram of each document, and the offsets of each document's hashes.

    An n-gram hashes by Horner's rule over its word hashes, run for all positions at once, then folded
    to 32 bits; a document shorter than one n-gram gets one hash over all its words, read off the
    step where Horner's rule has taken them all. Repeated n-grams stay: they cannot change a minimum.
    """
    counts, starts = np.diff(offsets), offsets[:-1]
    padded = np.concatenate([words, np.zeros(size, np.uint64)])
    rolling, short = padded[: len(words) + 1].copy(), np.zeros(len(counts), np.uint64)
    for j in range(size):
        if j:
            rolling = rolling * _WORD_BASE + padded[j : j + len(rolling)]
        short[counts == j + 1] = rolling[starts[counts == j + 1]]
    per_doc = np.maximum(counts - size + 1, 1)
    first = np.concatenate([[0], np.cumsum(per_doc)])
    hashes = rolling[np.repeat(starts - first[:-1], per_doc) + np.arange(first[-1])]
    hashes[first[:-1][counts < size]] = short[counts < size]
    return (hashes ^ (hashes >> np.uint64(32))).astype(np.uint32), first


def _permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """datasketch's affine32 permutations (a odd, b) for `seed`, drawn as `MinHash` draws them."""
    gen = np.random.RandomState(seed)
    a = gen.randint(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    return a, gen.randint(0, 1 << 32, num_perm, dtype=np.uint32)


def _min_hashes(hashes: np.ndarray, first: np.ndarray, a: np.ndarray, b: np.ndarray, block: int = 8192) -> np.ndarray:
    """[documents, num_perm]: per document, min over its hashes h of a * fmix32(h) + b mod 2^32.

    The hashes go in fixed blocks, which a long document may span, through one [num_perm, block]
    buffer: it stays in cache and is not allocated anew, whatever the documents' lengths.
    """
    hashes = _fmix(hashes)
    signatures = np.full((len(a), len(first) - 1), np.iinfo(np.uint32).max, np.uint32)
    buffer = np.empty((len(a), block), np.uint32)
    for start in range(0, len(hashes), block):
        values = buffer[:, : min(block, len(hashes) - start)]
        end = start + values.shape[1]
        np.multiply(a[:, None], hashes[start:end], out=values)
        values += b[:, None]
        docs = slice(np.searchsorted(first, start, "right") - 1, np.searchsorted(first, end - 1, "right"))
        minima = np.minimum.reduceat(values, np.maximum(first[docs] - start, 0), axis=1)
        np.minimum(signatures[:, docs], minima, out=signatures[:, docs])
    return np.ascontiguousarray(signatures.T)


def _signatures(texts: list[str], shingle_size: int, num_perm: int, seed: int) -> np.ndarray:
    """One chunk's signatures: each step below is a few numpy passes over the whole chunk."""
    parts = [_word_bytes(text) for text in texts]
    words, word_starts = _word_hashes(b" " + b" ".join(parts) + b" ")
    doc_starts = np.cumsum([1] + [len(part) + 1 for part in parts])
    hashes, first = _shingle_hashes(words, np.searchsorted(word_starts, doc_starts), shingle_size)
    return _min_hashes(hashes, first, *_permutations(num_perm, seed))


def minhash_signatures(
    texts: list[str], shingle_size: int, num_perm: int, seed: int = 1, num_workers: int = 1, chunk: int = 2000
) -> np.ndarray:
    """[len(texts), num_perm] uint32 MinHash values, computed in chunks over num_workers threads.

    Threads, not processes: numpy releases the GIL in the whole-array passes that take nearly all the
    time, and threads neither fork nor pickle texts and signatures, which added a third to a half to
    the CPU time with processes.
    """
    work = partial(_signatures, shingle_size=shingle_size, num_perm=num_perm, seed=seed)
    chunks = [texts[i : i + chunk] for i in range(0, len(texts), chunk)]
    with ThreadPoolExecutor(num_workers) as pool:
        parts = list(progress(pool.map(work, chunks), desc="minhash", unit="chunk", total=len(chunks)))
    return np.concatenate(parts) if parts else np.zeros((0, num_perm), np.uint32)


def lsh_bands(threshold: float, num_perm: int) -> list[tuple[int, int]]:
    """MinHashLSH's bands (column ranges of a signature) for this threshold, leaning towards recall."""
    return MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(0.2, 0.8)).hashranges


def band_keys(signatures: np.ndarray, bands: list[tuple[int, int]]) -> np.ndarray:
    """[documents, bands] uint64: a key per band that equal bands share (a collision of two different bands
    only sends a document to the exact check of `_near_duplicates`)."""
    keys = np.zeros((len(signatures), len(bands)), np.uint64)
    for band, (start, end) in enumerate(bands):
        for column in signatures[:, start:end].T:
            keys[:, band] = keys[:, band] * _WORD_BASE + column
    return keys


def _sharing_a_band(signatures: np.ndarray, bands: list[tuple[int, int]]) -> np.ndarray:
    """Which documents equal another one in some band: the only ones an LSH query can pair, so that the
    index loop runs over these documents only."""
    shared = np.zeros(len(signatures), bool)
    for keys in band_keys(signatures, bands).T:
        _, group, size = np.unique(keys, return_inverse=True, return_counts=True)
        shared |= size[group] > 1
    return shared


def near_duplicates(
    signatures: np.ndarray, candidates: np.ndarray, bands: list[tuple[int, int]], threshold: float
) -> set[int]:
    """Which candidates to drop, by MinHashLSH's keep-first loop in input order: one is dropped when an
    earlier kept one shares a band with it and their estimated Jaccard similarity reaches threshold."""
    buckets, dropped = [{} for _ in bands], set()
    for index in candidates.tolist():
        row = signatures[index]
        keys = [row[start:end].tobytes() for start, end in bands]
        others = sorted({other for bucket, key in zip(buckets, keys) for other in bucket.get(key, ())})
        if others and (signatures[others] == row).mean(axis=1).max() >= threshold:
            dropped.add(index)
        else:
            for bucket, key in zip(buckets, keys):
                bucket.setdefault(key, []).append(index)
    return dropped


def dedup_near(
    docs: list[Document],
    ledger: Ledger,
    threshold: float = 0.8,
    num_perm: int = 128,
    shingle_size: int = 5,
    seed: int = 1,
    num_workers: int = 1,
) -> list[Document]:
    """Drop a document whose estimated Jaccard similarity to an earlier kept one reaches threshold.

    The LSH bands lean towards recall (false negatives weigh 0.8), and every candidate is checked
    against the threshold with its MinHash estimate, so false positives are not dropped.
    """
    signatures = minhash_signatures([d.text for d in docs], shingle_size, num_perm, seed, num_workers)
    bands = lsh_bands(threshold, num_perm)
    candidates = np.flatnonzero(_sharing_a_band(signatures, bands))
    dropped = near_duplicates(signatures, candidates, bands, threshold)
    kept = []
    for index, doc in enumerate(docs):
        if index in dropped:
            ledger.drop(doc, "near_duplicate")
        else:
            kept.append(doc)
    return kept
