"""What `peft=lora|dora` adds to the plan (glm46.planning.plan): the adapters' parameter count and share, and the
names of the dtypes the frozen base and the trained tensors are stored in."""

from __future__ import annotations

from glm46.modules import GLM46Config
from glm46.peft import AdapterSettings, is_adapter_name
from glm46.planning.counts import model_parameters

DTYPES = {1: "fp8", 2: "bf16", 4: "fp32"}  # bytes per element -> the dtype a plan names (peft.base_dtype's)


def dtype_name(itemsizes: set[int]) -> str:
    """'bf16', 'fp32', or 'bf16+fp32' for tensors of several dtypes ('none' for no tensors)."""
    return "+".join(DTYPES[size] for size in sorted(itemsizes)) or "none"


def adapter_counts(config: GLM46Config, peft: AdapterSettings) -> dict:
    """The adapters' parameters, everything trained (the adapters, and the embedding or lm_head named in
    peft.targets, whole) and every parameter of the adapted model (the base and the adapters), from the model built
    on meta with glm46.peft.add_adapters, as training builds it."""
    parameters = model_parameters(config, peft)
    whole = [p.name for p in parameters if p.trained and not is_adapter_name(p.name)]
    return {
        "method": peft.method,
        "r": peft.r,
        "alpha": peft.alpha,
        "targets": list(peft.targets),
        "experts": peft.experts,
        "base_dtype": peft.base_dtype,
        "adapters": sum(p.numel for p in parameters if is_adapter_name(p.name)),
        "trained": sum(p.numel for p in parameters if p.trained),
        "trained_whole": whole,
        "total": sum(p.numel for p in parameters),
    }


def format_adapters(counts: dict) -> str:
    """The plan's line on the adapters: their count and share of all parameters, and what else trains whole."""
    experts = f", {counts['experts']} experts" if "experts" in counts["targets"] else ""
    line = (
        f"adapters (peft={counts['method']}, r {counts['r']}, alpha {counts['alpha']:g}{experts}; on "
        f"{', '.join(counts['targets'])}): {counts['adapters']:,} parameters = "
        f"{counts['adapters'] / counts['total']:.3%} of all {counts['total']:,}; the base frozen in "
        f"{counts['base_dtype']}"
    )
    if counts["trained_whole"]:
        line += (
            f"; trained whole: {', '.join(counts['trained_whole'])} ({counts['trained']:,} trained in all, "
            f"{counts['trained'] / counts['total']:.3%})"
        )
    return line
