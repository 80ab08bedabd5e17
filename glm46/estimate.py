"""Parameter counts of a GLM46Config, from the model itself built on the meta device (no memory used).

Conventions (reference/GLM.md section 4): `total` includes embedding, lm_head and MTP layers;
`active` is what one token runs through in the main model: attention and norms of every layer,
dense MLPs, routers, shared experts, top-k of the routed experts and the final norm; not the
embedding lookup, the lm_head or the MTP layers. The GLM paper's "355B" is total - embedding - lm_head.
"""

from __future__ import annotations

import torch

from glm46.modules import GLM46Config, GLM46ForCausalLM
from glm46.modules.experts import GroupedExperts


def count_parameters(config: GLM46Config) -> dict[str, int]:
    with torch.device("meta"):
        model = GLM46ForCausalLM(config)
    numel = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    total = numel(model)
    embedding = numel(model.model.embed_tokens)
    lm_head = numel(model.lm_head)
    mtp = numel(model.mtp_layers)
    routed = routed_active = 0
    for module in model.model.layers.modules():
        if isinstance(module, GroupedExperts):
            routed += numel(module)
            routed_active += numel(module) // config.n_routed_experts * config.num_experts_per_tok
    active = total - embedding - lm_head - mtp - routed + routed_active
    return {"total": total, "embedding": embedding, "lm_head": lm_head, "mtp": mtp, "active": active}


def _short(n: int) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def format_counts(name: str, counts: dict[str, int]) -> str:
    """A readable table of the counts, with the paper's convention alongside."""
    rows = [
        ("total (incl. embedding, lm_head, MTP)", counts["total"]),
        ("embedding", counts["embedding"]),
        ("lm_head", counts["lm_head"]),
        ("MTP layers", counts["mtp"]),
        ("total - embedding - lm_head (paper's size)", counts["total"] - counts["embedding"] - counts["lm_head"]),
        ("total - MTP (transformers' model)", counts["total"] - counts["mtp"]),
        ("active per token", counts["active"]),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"parameters of model={name}"]
    lines += [f"  {label:<{width}}  {value:>18,}  ({_short(value)})" for label, value in rows]
    return "\n".join(lines)
