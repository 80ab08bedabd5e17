"""What a prepared dataset and a starting checkpoint say about a run before it is built: the vocabulary its model
needs, the natural mixture of its domains, where the weights' config and tokenizer are, and the architecture in that
config (model=auto). The one-stage runs on
your own data read them through `${dataset_vocab:...}` and `${dataset_mixture:...}` (glm46.config.resolvers); the
composition checks compare them (glm46.config.data_checks.check_vocabulary)."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from glm46.checkpoint.hub_config import config_from_hf
from glm46.checkpoint.hub_files import weights_folder
from glm46.data.shards import read_index
from glm46.modules import GLM46Config

# A vocabulary taken from a tokenizer is padded to a multiple of this (Megatron's --make-vocab-size-divisible-by
# default), so that the embedding and the LM head split evenly over tensor-parallel ranks and keep aligned shapes.
VOCAB_MULTIPLE = 128


def prepared_index(path: str | Path, key: str = "data.path") -> dict:
    """tokens/shards.json of the prepared dataset at `path`; a ValueError naming `key` and what to run if there is
    none."""
    try:
        return read_index(Path(path) / "tokens")
    except OSError as error:
        raise ValueError(
            f"{key}={path} holds no prepared dataset ({Path(path) / 'tokens' / 'shards.json'}: "
            f"{error.__class__.__name__}); prepare it first with python run.py task=prepare source=<reader> "
            f"source.paths='[...]' source.output_dir={path}"
        ) from None


@functools.cache
def _checkpoint_config(folder: Path, modified: float) -> GLM46Config:
    return config_from_hf(json.loads((folder / "config.json").read_text()))


def checkpoint_config(init_from: str | Path | None) -> GLM46Config:
    """The architecture in `init_from`'s config.json (model=auto); a ValueError naming init_from if there is none."""
    folder = weights_folder(init_from)
    if folder is None:
        raise ValueError(
            f"model=auto takes the architecture from init_from's config.json, and init_from={init_from} has none: "
            f"set init_from to an HF directory (GLM's released weights) or a run directory, or name a model="
        )
    return _checkpoint_config(folder, (folder / "config.json").stat().st_mtime)


def checkpoint_field(init_from: str | None, key: str):
    """`${checkpoint_field:${init_from},hidden_size}`: one field of init_from's architecture (conf/model/auto.yaml)."""
    return getattr(checkpoint_config(init_from), key)


def padded_vocab(tokens: int) -> int:
    return math.ceil(tokens / VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def dataset_vocab(path: str, init_from: str | None = None) -> int:
    """The model's vocabulary for training on the dataset at `path`: `init_from`'s (its weights fix it) where it has
    a config.json, else the dataset's tokenizer padded to VOCAB_MULTIPLE. Whether both agree is checked apart."""
    weights = weights_folder(init_from)
    if weights is not None:
        return int(json.loads((weights / "config.json").read_text())["vocab_size"])
    return padded_vocab(int(prepared_index(path)["vocab_size"]))


def dataset_mixture(path: str) -> dict[str, float]:
    """Every domain of the dataset at `path`, weighted by its share of the tokens (the data as it is)."""
    domains = prepared_index(path)["domains"]
    total = sum(int(counts["tokens"]) for counts in domains.values()) or 1
    return {name: round(int(counts["tokens"]) / total, 6) for name, counts in domains.items() if counts["tokens"]}
