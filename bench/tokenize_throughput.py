"""Tokenize-to-shard throughput: glm46's encoder (tiktoken over the trained merges, documents joined
with EOS into 1 MB chunks, encoded by threads into uint32 arrays) against the `tokenizers` batch
encoder, same tokenizer, same documents; the ids must be identical.

The two alternate `--repeats` times and the best of each is reported, as the machine may be shared;
tokens per CPU-second (all threads of the process) tell how much of that is other load.

    python bench/tokenize_throughput.py --vocab 8192
"""

from __future__ import annotations

import argparse

import numpy as np
from timing import timed

from glm46.data.documents import Ledger
from glm46.data.embedded import read_embedded
from glm46.data.shards import EOS, encode_documents
from glm46.data.tokenizer import GLMTokenizer, train_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    texts = [doc.text for doc in read_embedded([], Ledger())]
    tokenizer = GLMTokenizer(train_tokenizer(texts[:2000], args.vocab))
    eos = tokenizer.token_id(EOS)
    print(f"{len(texts)} documents, {sum(map(len, texts)) / 1e6:.1f} M characters, vocabulary {args.vocab}")

    best = {"tokenizers encode_batch": [0.0, 0.0], f"glm46 encode_documents ({args.threads} threads)": [0.0, 0.0]}
    for repeat in range(args.repeats):
        reference, *peer = timed(lambda: tokenizer.tokenizer.encode_batch(texts))
        (tokens, _), *ours = timed(lambda: encode_documents(texts, tokenizer, num_threads=args.threads))
        expected = np.concatenate([np.array(e.ids + [eos], dtype=np.uint32) for e in reference])
        for name, (wall, cpu) in zip(best, (peer, ours)):
            best[name] = [max(best[name][0], len(expected) / wall), max(best[name][1], len(expected) / cpu)]
            print(
                f"run {repeat + 1}: {name:40s} {len(expected) / wall / 1e6:6.2f} M tokens/s"
                f"  {len(expected) / cpu / 1e6:6.2f} M tokens/CPU-s"
            )
        print(f"run {repeat + 1}: ids identical: {np.array_equal(tokens, expected)}")
    for name, (rate, cpu_rate) in best.items():
        print(f"best: {name:40s} {rate / 1e6:6.2f} M tokens/s  {cpu_rate / 1e6:6.2f} M tokens/CPU-s")
    (peer, peer_cpu), (ours, ours_cpu) = best.values()
    print(f"ratio: x{ours / peer:.2f} (per CPU-second x{ours_cpu / peer_cpu:.2f})")


if __name__ == "__main__":
    main()
