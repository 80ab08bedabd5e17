"""DCLM's quality classifier (Li et al., 2024, "DataComp-LM", arXiv:2406.11794): a fastText linear classifier
(Joulin et al., 2016) trained to tell reference documents (`__label__hq`; DCLM's were OpenHermes 2.5 and Reddit ELI5)
from the raw pool (`__label__cc`: Common Crawl), equal numbers of each; a document's score is its probability of
`__label__hq`. fastText reads one line per document, so a document's newlines become spaces, as DCLM's enricher does.

A classifier scoring the documents it was trained on has memorised them: on a pool of hundreds, held-out prose in
it scores as low as boilerplate. DCLM's pool dwarfs its 200,000 training documents; here the pool can be split into
`folds` by a hash of each text, one classifier trained without each fold, and a document scored by the one that did
not see it (cross-fitting).

Training runs on one thread with a fixed seed, in a fresh interpreter of its own: fastText's Hogwild updates over
several threads are not reproducible, and inside a long-lived process (a test worker after many tests) the same
call, bit for bit the same input, has come out different and even diverged at a rate that trains in a fresh one.
So the preparation is the same whatever the number of tasks and whatever ran before it. The wheel is
fasttext-numpy2-wheel (fastText 0.9.2's bindings built for NumPy 2).
"""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

HQ, CC = "__label__hq", "__label__cc"
MAGIC, VERSION = 793712314, 12  # the first two int32 of a fastText .bin (fastText's FASTTEXT_FILEFORMAT_MAGIC_INT32)
DIVERGED = 3  # the training interpreter's exit status when fastText raised (its "Encountered NaN.")
_TRAIN = f"""
import json, sys
import fasttext
examples, path, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
try:
    model = fasttext.train_supervised(examples, thread=1, verbose=0, **settings)
except RuntimeError as error:
    print(error, file=sys.stderr)
    sys.exit({DIVERGED})
model.save_model(path)
"""


def one_line(text: str) -> str:
    return " ".join(text.split())


def fold_of(text: str, folds: int) -> int:
    """A text's fold: the same whatever task reads it."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") % folds


def check_model_file(path: str | Path) -> None:
    """Raise ValueError unless `path` starts as a fastText 0.9 binary model does (its magic number and version);
    the model is not loaded (with bigram buckets one runs to hundreds of megabytes and more)."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or struct.unpack("<ii", head) != (MAGIC, VERSION):
        raise ValueError("not a fastText 0.9 binary model (wrong magic number or version)")


def train_classifier(reference: list[str], pool: list[str], path: Path, hyperparameters: dict, seed: int) -> int:
    """Train on the first n of `reference` (hq) and of `pool` (cc), n the smaller count, the lines in an order
    drawn from `seed`; save the model at `path`. Returns n. RuntimeError with fastText's message where its training
    raised (it diverged)."""
    count = min(len(reference), len(pool))
    lines = [f"{HQ} {one_line(t)}\n" for t in reference[:count]] + [f"{CC} {one_line(t)}\n" for t in pool[:count]]
    order = np.random.default_rng(seed).permutation(len(lines))
    examples = path.with_name("train.txt")
    examples.write_text("".join(lines[i] for i in order))
    settings = json.dumps(dict(hyperparameters) | {"seed": seed})
    done = subprocess.run(
        [sys.executable, "-c", _TRAIN, str(examples), str(path), settings], capture_output=True, text=True
    )
    examples.unlink()
    if done.returncode == DIVERGED:
        raise RuntimeError(done.stderr.strip())
    if done.returncode:
        raise ChildProcessError(f"fastText's training exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return count


class QualityClassifier:
    """A fastText classifier with labels `__label__hq` and `__label__cc` (DCLM's released model has them)."""

    def __init__(self, path: str | Path):
        import fasttext

        self.model = fasttext.load_model(str(path))
        if HQ not in self.model.get_labels():
            raise ValueError(f"the model's labels are {self.model.get_labels()}, not {HQ} and {CC}")

    def scores(self, texts: list[str]) -> list[float]:
        """Per text, the probability of `__label__hq`."""
        if not texts:
            return []
        labels, probabilities = self.model.predict([one_line(t) for t in texts], k=-1)
        return [float(dict(zip(names, p))[HQ]) for names, p in zip(labels, probabilities)]
