"""Tokenize-to-shard throughput: glm46's encoder (tiktoken over the trained merges, documents joined
with EOS into 1 MB chunks) against the `tokenizers` batch encoder, same tokenizer, same documents.

    python bench/tokenize_throughput.py --vocab 8192
"""

from __future__ import annotations

import argparse
import time

from glm46.data.documents import Ledger
from glm46.data.embedded import read_embedded
from glm46.data.shards import encode_documents
from glm46.data.tokenizer import GLMTokenizer, train_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    texts = [doc.text for doc in read_embedded([], Ledger())]
    tokenizer = GLMTokenizer(train_tokenizer(texts[:2000], args.vocab))
    print(f"{len(texts)} documents, {sum(map(len, texts)) / 1e6:.1f} M characters, vocabulary {args.vocab}")

    start = time.perf_counter()
    tokens, _ = encode_documents(texts, tokenizer, num_threads=args.threads)
    ours = len(tokens) / (time.perf_counter() - start)
    start = time.perf_counter()
    reference = tokenizer.tokenizer.encode_batch(texts)
    peer = sum(len(e.ids) + 1 for e in reference) / (time.perf_counter() - start)
    print(f"tokenizers encode_batch          {peer / 1e6:6.2f} M tokens/s")
    print(f"glm46 encode_documents (tiktoken) {ours / 1e6:6.2f} M tokens/s")
    print(f"ratio: x{ours / peer:.2f}")


if __name__ == "__main__":
    main()
