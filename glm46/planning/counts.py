"""Parameter counts of a GLM46Config, from the model itself built on the meta device (no memory used).

Conventions: `total` includes embedding, lm_head and MTP layers;
`active` is what one token runs through in the main model: attention and norms of every layer,
dense MLPs, routers, shared experts, top-k of the routed experts and the final norm; not the
embedding lookup, the lm_head or the MTP layers. The GLM-4.5 report's "355B total, 32B active" (arXiv:2508.06471,
Table 1: "include MTP, not word embeddings and output layer") is total - embedding - lm_head = 355,233,991,936,
and active = 32,080,359,424 (tests/test_configs.py checks both).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict
from typing import NamedTuple

import torch

from glm46.modules import GLM46Config, GLM46ForCausalLM
from glm46.optim import muon_param_groups
from glm46.peft import AdapterSettings, add_adapters


class ModelParameter(NamedTuple):
    """A parameter of the model built on meta, as training holds it."""

    name: str
    shape: tuple[int, ...]
    muon: bool  # Muon updates it (never under PEFT: the adapters train in AdamW's group)
    itemsize: int = 4  # bytes per element as stored: fp32, or PEFT's frozen base in peft.base_dtype
    trained: bool = True  # False: PEFT's frozen base, which has no gradient and no optimizer state

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def model_parameters(config: GLM46Config, peft: AdapterSettings | None = None) -> tuple[ModelParameter, ...]:
    """Every parameter of the model built on meta, with `peft`'s adapters on its frozen base when given
    (glm46.peft.add_adapters, as training adds them). Built once per configuration: planning asks again for every
    pipeline stage, and building the 355B model on meta takes about 0.5 s (93 layers of 160 experts, their
    initialisers run on meta)."""
    settings = None if peft is None else json.dumps(asdict(peft), default=list)  # targets may be a ListConfig
    return _model_parameters(json.dumps(asdict(config)), settings)


@functools.lru_cache(maxsize=4)
def _model_parameters(config_json: str, peft_json: str | None) -> tuple[ModelParameter, ...]:
    with torch.device("meta"):  # keyed by the configurations' JSON: the dataclasses are not hashable
        model = GLM46ForCausalLM(GLM46Config(**json.loads(config_json)))
    if peft_json is not None:
        add_adapters(model, AdapterSettings(**json.loads(peft_json)))
        return tuple(
            ModelParameter(name, tuple(p.shape), False, p.dtype.itemsize, p.requires_grad)
            for name, p in model.named_parameters()
        )
    muon = {id(p) for group in muon_param_groups(model) if group["use_muon"] for p in group["params"]}
    return tuple(ModelParameter(name, tuple(p.shape), id(p) in muon) for name, p in model.named_parameters())


def count_parameters(config: GLM46Config) -> dict[str, int]:
    """total, embedding, lm_head, mtp, active; plus mtp_active (an MTP layer's per-token share)."""
    sizes = {p.name: p.numel for p in model_parameters(config)}

    def numel(prefix: str) -> int:
        return sum(n for name, n in sizes.items() if name.startswith(prefix))

    def inactive(prefix: str) -> int:  # routed-expert parameters under `prefix` that a token does not run through
        routed = sum(n for name, n in sizes.items() if name.startswith(prefix) and ".mlp.experts." in name)
        return routed - routed // config.n_routed_experts * config.num_experts_per_tok

    counts = {
        "total": sum(sizes.values()),
        "embedding": numel("model.embed_tokens."),
        "lm_head": numel("lm_head."),
        "mtp": numel("mtp_layers."),
    }
    main = counts["total"] - counts["embedding"] - counts["lm_head"] - counts["mtp"]
    counts["active"] = main - inactive("model.")
    counts["mtp_active"] = counts["mtp"] - inactive("mtp_layers.")
    return counts


def training_flops_per_token(config: GLM46Config, seq_len: int) -> float:
    """Matmul FLOPs of forward + backward per token, torchtitan's convention: 6 x active matmul parameters
    (main model, lm_head, MTP layers) + 12 x layers x heads x head_dim x seq_len for attention."""
    counts = count_parameters(config)
    heads = 1 + config.num_nextn_predict_layers  # the main model and every MTP layer run the lm_head
    matmul_params = counts["active"] + counts["mtp_active"] + heads * counts["lm_head"]
    layers = config.num_hidden_layers + config.num_nextn_predict_layers
    attention = 12 * layers * config.num_attention_heads * config.head_dim * seq_len
    return 6 * matmul_params + attention


def _short(n: int) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


# The sizes the GLM-4.5 report publishes (arXiv:2508.06471, Table 1: "include MTP, not word embeddings and output
# layer"), by model config name; GLM-4.6 keeps GLM-4.5's architecture.
REPORTED = {
    "glm45_355b": ("355B", "32B"),
    "glm46_355b": ("355B", "32B"),
    "glm45_air_106b": ("106B", "12B"),
}


def format_counts(name: str, counts: dict[str, int]) -> str:
    """A readable table of the counts; for a published model, the report's figures beside ours by its definition."""
    by_report = counts["total"] - counts["embedding"] - counts["lm_head"]
    rows = [
        ("total (incl. embedding, lm_head, MTP)", counts["total"]),
        ("embedding", counts["embedding"]),
        ("lm_head", counts["lm_head"]),
        ("MTP layers", counts["mtp"]),
        ("total - embedding - lm_head (the report's definition)", by_report),
        ("total - MTP (transformers' model)", counts["total"] - counts["mtp"]),
        ("active per token", counts["active"]),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"parameters of model={name}"]
    lines += [f"  {label:<{width}}  {value:>18,}  ({_short(value)})" for label, value in rows]
    if name in REPORTED:
        total, active = REPORTED[name]
        lines.append(
            f"  the GLM-4.5 report (Table 1, MTP included, embedding and output layer not): {total} total, {active} "
            f"active; ours by that definition: {_short(by_report)} total, {_short(counts['active'])} active"
        )
    return "\n".join(lines)
