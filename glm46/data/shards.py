"""Token shards: per domain, the documents' ids end to end, each followed by <|endoftext|>, as a flat
memory-mapped array (uint16 when the vocabulary fits, else uint32) plus document offsets, with a
content fingerprint that ties a training run to exactly these tokens and this tokenizer."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

from glm46.errors import ConfigError

from .loop_progress import progress
from .tokenizer import GLMTokenizer

EOS = "<|endoftext|>"
CHUNK_TOKENS = 1 << 20  # the fingerprint hashes the tokens in pieces of this many


def load_tokenizer(path: str | Path) -> GLMTokenizer:
    """The tokenizer.json at `path` (prepare.tokenizer.path), which must have the document-end token."""
    tokenizer = GLMTokenizer.from_file(path)
    if tokenizer.tokenizer.token_to_id(EOS) is None:
        raise ConfigError(
            f"prepare.tokenizer.path={path}: the tokenizer has no {EOS!r} token, which "
            f"ends every document in the token shards"
        )
    return tokenizer


def _chunks(texts: list[str], chunk_chars: int) -> list[list[str]]:
    """Consecutive texts in groups of about chunk_chars characters."""
    chunks, current, size = [], [], 0
    for text in texts:
        current.append(text)
        size += len(text)
        if size >= chunk_chars:
            chunks.append(current)
            current, size = [], 0
    return chunks + [current] if current else chunks


def _encode_chunk(tokenizer: GLMTokenizer, eos: int, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, end offset of each text's ids + EOS) of texts joined with EOS into one string.

    A text that holds a literal EOS (it encodes to the EOS id, as in `tokenizers`) would shift the
    ends, so such a chunk is encoded text by text.
    """
    ids = tokenizer.encode_to_numpy(EOS.join(texts) + EOS)
    ends = np.flatnonzero(ids == eos) + 1
    if len(ends) != len(texts):
        pieces = [np.append(tokenizer.encode_to_numpy(text), np.uint32(eos)) for text in texts]
        ids, ends = np.concatenate(pieces), np.cumsum([len(piece) for piece in pieces])
    return ids, ends


def encode_documents(
    texts: list[str], tokenizer: GLMTokenizer, chunk_chars: int = 1 << 20, num_threads: int = 2
) -> tuple[np.ndarray, np.ndarray]:
    """Ids of every text followed by EOS, flat uint32, and offsets [len(texts) + 1] of each document's start.

    Texts are joined with the EOS string into ~1 MB chunks, encoded by num_threads threads: tiktoken
    splits at special tokens first, so this equals encoding each text alone (tested) without per-text
    overhead, and it returns each chunk as one array, which is concatenated once at the end.
    """
    eos, chunks = tokenizer.token_id(EOS), _chunks(texts, chunk_chars)
    with ThreadPoolExecutor(num_threads) as pool:
        encoded = list(
            progress(
                pool.map(partial(_encode_chunk, tokenizer, eos), chunks),
                desc="tokenize",
                unit="chunk",
                total=len(chunks),
            )
        )
    starts = np.cumsum([0] + [len(ids) for ids, _ in encoded])
    tokens = np.concatenate([ids for ids, _ in encoded]) if encoded else np.zeros(0, np.uint32)
    offsets = np.concatenate([[0]] + [ends + start for (_, ends), start in zip(encoded, starts)])
    return tokens, offsets.astype(np.int64)


def write_shards(
    dataset_dir: str | Path, tokenizer: GLMTokenizer, output_dir: str | Path | None = None, num_threads: int = 2
) -> dict:
    """Tokenize `documents/<domain>.jsonl` of a prepared dataset into `tokens/<domain>.bin` + `.idx.npy`."""
    dataset_dir = Path(dataset_dir)
    output_dir = Path(output_dir or dataset_dir / "tokens")
    output_dir.mkdir(parents=True, exist_ok=True)
    dtype, fingerprint = token_dtype(tokenizer), shards_fingerprint(tokenizer)
    domains = {}
    for file in sorted((dataset_dir / "documents").glob("*.jsonl")):
        texts = [json.loads(line)["text"] for line in file.read_text().splitlines()]
        tokens, offsets = encode_documents(texts, tokenizer, num_threads=num_threads)
        tokens = tokens.astype(dtype, copy=False)
        tokens.tofile(output_dir / f"{file.stem}.bin")
        np.save(output_dir / f"{file.stem}.idx.npy", offsets)
        fingerprint.update(file.stem.encode())
        for chunk in range(0, len(tokens), CHUNK_TOKENS):
            fingerprint.update(chunk_digest(tokens[chunk : chunk + CHUNK_TOKENS]))
        domains[file.stem] = {"documents": len(texts), "tokens": int(len(tokens))}
    return write_index(output_dir, tokenizer, dtype, fingerprint.hexdigest(), domains)


def token_dtype(tokenizer: GLMTokenizer) -> type:
    return np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32


def chunk_digest(tokens: np.ndarray) -> bytes:
    return hashlib.blake2b(tokens, digest_size=16).digest()


def shards_fingerprint(tokenizer: GLMTokenizer):
    """The running digest of a tokens folder: the tokenizer, then each domain's name and the digests of its tokens'
    CHUNK_TOKENS pieces in turn. Digests of pieces, not of the whole stream, so that a staged preparation's tasks
    hash their own parts side by side (glm46.data.staged) and get the same fingerprint."""
    return hashlib.blake2b(tokenizer.tokenizer.to_str().encode(), digest_size=16)


def write_index(output_dir: Path, tokenizer: GLMTokenizer, dtype: type, fingerprint: str, domains: dict) -> dict:
    """shards.json: the dtype, vocabulary, document-end id, fingerprint and per-domain counts of a tokens folder."""
    index = {
        "dtype": np.dtype(dtype).name,
        "vocab_size": tokenizer.vocab_size,
        "eos_token_id": tokenizer.token_id(EOS),
        "fingerprint": fingerprint,
        "domains": domains,
    }
    (output_dir / "shards.json").write_text(json.dumps(index, indent=2))
    return index


def read_index(tokens_dir: str | Path) -> dict:
    """shards.json of a tokens folder; a file that does not parse is an error naming it."""
    file = Path(tokens_dir) / "shards.json"
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{file} is not valid JSON ({error}): prepare the dataset again") from None


def load_shard(tokens_dir: str | Path, domain: str) -> tuple[np.memmap, np.ndarray]:
    """(tokens as a read-only memory map, document offsets) of one domain.

    Each file is checked against shards.json's token count, so a truncated or cut-short copy fails here,
    naming the file, instead of in the middle of training (a change of bytes in place is not detected:
    that would take reading the whole shard)."""
    tokens_dir = Path(tokens_dir)
    index = read_index(tokens_dir)
    count, dtype = index["domains"][domain]["tokens"], np.dtype(index["dtype"])
    data, idx = tokens_dir / f"{domain}.bin", tokens_dir / f"{domain}.idx.npy"
    if not data.exists():
        raise FileNotFoundError(f"{data} is missing: prepare the dataset again")
    if data.stat().st_size != count * dtype.itemsize:
        raise ValueError(
            f"{data} holds {data.stat().st_size} bytes but shards.json records {count} {dtype.name} "
            f"tokens ({count * dtype.itemsize} bytes): the file is truncated or corrupted; "
            f"prepare the dataset again"
        )
    try:
        offsets = np.load(idx)
    except (OSError, ValueError, EOFError) as error:  # missing, truncated or not a .npy file
        raise ValueError(f"{idx} does not load ({error}): prepare the dataset again") from None
    documents = index["domains"][domain]["documents"]
    if offsets.shape != (documents + 1,) or offsets[0] != 0 or offsets[-1] != count:
        raise ValueError(
            f"{idx} does not hold the {documents + 1} document offsets 0 ... {count} that shards.json "
            f"records: prepare the dataset again"
        )
    return np.memmap(data, dtype=dtype, mode="r"), offsets
