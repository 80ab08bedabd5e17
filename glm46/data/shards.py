"""Token shards: per domain, the documents' ids end to end, each followed by <|endoftext|>, as a flat
memory-mapped array (uint16 when the vocabulary fits, else uint32) plus document offsets, with a
content fingerprint that ties a training run to exactly these tokens and this tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .tokenizer import GLMTokenizer

EOS = "<|endoftext|>"


def encode_documents(texts: list[str], tokenizer: GLMTokenizer, chunk_chars: int = 1 << 20,
                     num_threads: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Ids of every text followed by EOS, flat, and offsets [len(texts) + 1] of each document's start.

    Texts are joined with the EOS string into ~1 MB chunks encoded in parallel: tiktoken splits at
    special tokens first, so this equals encoding each text alone (tested) without per-text overhead.
    """
    eos = tokenizer.token_id(EOS)
    chunks, current, size = [], [], 0
    for text in texts:
        current.append(text)
        size += len(text)
        if size >= chunk_chars:
            chunks.append(current)
            current, size = [], 0
    if current:
        chunks.append(current)
    joined = [EOS.join(chunk) + EOS for chunk in chunks]
    pieces = []
    for batch_start in tqdm(range(0, len(joined), 8 * num_threads), desc="tokenize", unit="chunk", leave=False,
                            total=-(-len(joined) // (8 * num_threads))):
        batch = joined[batch_start : batch_start + 8 * num_threads]
        for chunk, ids in zip(chunks[batch_start:], tokenizer.encode_batch(batch, num_threads=num_threads)):
            ids = np.asarray(ids, dtype=np.uint32)
            if np.count_nonzero(ids == eos) != len(chunk):  # a text holds a literal EOS: encode one by one
                ids = np.concatenate([np.asarray(tokenizer.encode(t) + [eos], dtype=np.uint32) for t in chunk])
            pieces.append(ids)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint32)
    ends = np.flatnonzero(tokens == eos) + 1
    if len(ends) != len(texts):  # literal EOS inside a text that the fallback kept as EOS: count per text
        lengths = [len(tokenizer.encode(t)) + 1 for t in texts]
        ends = np.cumsum(lengths)
    return tokens, np.concatenate([[0], ends]).astype(np.int64)


def write_shards(dataset_dir: str | Path, tokenizer: GLMTokenizer, output_dir: str | Path | None = None,
                 num_threads: int = 2) -> dict:
    """Tokenize `documents/<domain>.jsonl` of a prepared dataset into `tokens/<domain>.bin` + `.idx.npy`."""
    dataset_dir = Path(dataset_dir)
    output_dir = Path(output_dir or dataset_dir / "tokens")
    output_dir.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    fingerprint = hashlib.blake2b(tokenizer.tokenizer.to_str().encode(), digest_size=16)
    domains = {}
    for file in sorted((dataset_dir / "documents").glob("*.jsonl")):
        texts = [json.loads(line)["text"] for line in file.read_text().splitlines()]
        tokens, offsets = encode_documents(texts, tokenizer, num_threads=num_threads)
        tokens = tokens.astype(dtype)
        tokens.tofile(output_dir / f"{file.stem}.bin")
        np.save(output_dir / f"{file.stem}.idx.npy", offsets)
        fingerprint.update(file.stem.encode() + tokens.tobytes())
        domains[file.stem] = {"documents": len(texts), "tokens": int(len(tokens))}
    index = {"dtype": np.dtype(dtype).name, "vocab_size": tokenizer.vocab_size, "eos_token_id": tokenizer.token_id(EOS),
             "fingerprint": fingerprint.hexdigest(), "domains": domains}
    (output_dir / "shards.json").write_text(json.dumps(index, indent=2))
    return index


def load_shard(tokens_dir: str | Path, domain: str) -> tuple[np.memmap, np.ndarray]:
    """(tokens as a read-only memory map, document offsets) of one domain."""
    tokens_dir = Path(tokens_dir)
    index = json.loads((tokens_dir / "shards.json").read_text())
    tokens = np.memmap(tokens_dir / f"{domain}.bin", dtype=index["dtype"], mode="r")
    return tokens, np.load(tokens_dir / f"{domain}.idx.npy")
