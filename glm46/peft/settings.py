"""What `peft=lora|dora` asks for (conf/peft): the method, the rank, the targets by name and the adapters' optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.utils import instantiate
from omegaconf import DictConfig

from glm46.errors import ConfigError

# Targets by name: each attention projection, the dense MLP (the first_k_dense_replace layers), the shared experts,
# the routed experts, and the embedding and lm_head, which are trained whole (not adapted) when named.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGETS = (*ATTENTION, "dense_mlp", "shared_experts", "experts", "embed_tokens", "lm_head")
ALIASES = {"attention": ATTENTION}
TRAINED_WHOLE = ("embed_tokens", "lm_head")
METHODS = ("lora", "dora")
EXPERT_VARIANTS = ("per_expert", "shared")
BASE_DTYPES = ("bfloat16", "float32", "fp8")  # torch dtype names, and block FP8 (glm46.peft.fp8_base)


@dataclass
class AdapterSettings:
    """method: lora or dora (DoRA: peft's formulation). r, alpha: the rank and LoRA's alpha (scaling alpha / r).
    dropout: on the adapters' input (0 by default: on-policy RL wants none, and peft's parameter targets, which the
    experts and MLPs export through, support none). targets: names from TARGETS (`attention` = q, k, v, o).
    experts: per_expert (each routed expert its own pair) or shared (one pair for a layer's experts).
    base_dtype: the frozen base's storage dtype (bfloat16, half of fp32's bytes, where training computes in bf16;
    float32 keeps the CPU exact; fp8: the decoder layers' matrices in block FP8, one byte each, dequantized per use,
    the rest in bf16, as GLM-4.6-FP8 is released: glm46.peft.fp8_base).
    trainable_tokens: tokens whose rows of the embedding and the lm_head (of either not trained whole) train, the
    other rows frozen (peft's trainable_token_indices; `special`: every special token of init_from's tokenizer;
    glm46.peft.token_rows).
    adapter: a peft-format adapter directory to start from (on top of init_from). lr, weight_decay: AdamW's, for the
    adapters (and the embedding or lm_head when named)."""

    method: str = "lora"
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["attention", "dense_mlp", "shared_experts", "experts"])
    experts: str = "per_expert"
    base_dtype: str = "float32"
    trainable_tokens: list[str] = field(default_factory=list)
    adapter: str | None = None
    lr: float = 1.0e-4
    weight_decay: float = 0.0

    def __post_init__(self):
        for key, value, allowed in (
            ("method", self.method, METHODS),
            ("experts", self.experts, EXPERT_VARIANTS),
            ("base_dtype", self.base_dtype, BASE_DTYPES),
        ):
            if value not in allowed:
                raise ValueError(f"peft.{key}={value!r}: expected one of {list(allowed)}")
        unknown = [t for t in self.targets if t not in TARGETS and t not in ALIASES]
        if unknown:
            raise ValueError(f"peft.targets: unknown {unknown}; known: {[*ALIASES, *TARGETS]}")
        if self.r < 1:
            raise ValueError(f"peft.r={self.r}: the rank must be at least 1")
        if self.trainable_tokens and set(TRAINED_WHOLE) <= set(self.targets):
            raise ValueError(
                f"peft.trainable_tokens with peft.targets {list(TRAINED_WHOLE)}: both layers train whole, and no rows "
                "are left to train alone"
            )

    @property
    def dora(self) -> bool:
        return self.method == "dora"

    def target_names(self) -> set[str]:
        """The targets, aliases expanded."""
        return {name for target in self.targets for name in ALIASES.get(target, (target,))}


def peft_settings(cfg: DictConfig) -> AdapterSettings | None:
    """A composed run's AdapterSettings (its `peft` node), or None for full fine-tuning; a ConfigError naming the key
    it refuses."""
    if cfg.get("peft") is None:
        return None
    try:
        return instantiate(cfg.peft)
    except Exception as error:
        raise ConfigError(str(error.__cause__ or error).splitlines()[0]) from None
