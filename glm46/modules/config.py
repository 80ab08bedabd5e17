"""GLM46Config: the model's hyper-parameters, named as in transformers' `Glm4MoeConfig`.

The same dataclass is the Hydra schema of the `model` config group (registered in
`glm46.config.schema`), so a misspelt key or a wrong type fails when the config is composed, and
`validate()` rejects inconsistent shapes with the offending keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glm46.errors import ConfigError


@dataclass
class GLM46Config:
    vocab_size: int = 151552
    hidden_size: int = 5120
    intermediate_size: int = 12288  # dense SwiGLU layers (index < first_k_dense_replace)
    moe_intermediate_size: int = 1536  # per routed expert; shared experts use n_shared_experts x this
    num_hidden_layers: int = 92  # decoder layers, excluding MTP layers
    num_attention_heads: int = 96
    num_key_value_heads: int = 8
    head_dim: int = 128
    partial_rotary_factor: float = 0.5
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 202752
    attention_bias: bool = True  # q/k/v projections only; o_proj never has a bias
    use_qk_norm: bool = True
    first_k_dense_replace: int = 3
    n_routed_experts: int = 160
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    num_nextn_predict_layers: int = 1  # MTP layers
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    pad_token_id: int | None = None  # GLM-4.6: 151329
    eos_token_id: list[int] = field(default_factory=list)  # GLM-4.6: [151329, 151336, 151338]

    def __post_init__(self) -> None:
        self.validate()

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_layer_indices(self) -> list[int]:
        return list(range(self.first_k_dense_replace, self.num_hidden_layers))

    @property
    def has_moe(self) -> bool:
        """Whether some layer routes tokens to experts (an MTP layer always does)."""
        return bool(self.moe_layer_indices) or self.num_nextn_predict_layers > 0

    def validate(self) -> None:
        """Raise ConfigError naming every inconsistent key, with its value."""
        problems = []

        def check(ok: bool, message: str) -> None:
            if not ok:
                problems.append(message)

        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_group",
            "topk_group",
        ):
            value = getattr(self, key)
            check(value >= 1, f"{key}={value} must be >= 1")
        for key in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
            value = getattr(self, key)
            check(value >= 0, f"{key}={value} must be >= 0")
        if problems:  # the relations below assume positive sizes
            raise ConfigError("invalid model config: " + "; ".join(problems))

        check(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads={self.num_attention_heads} must be divisible by "
            f"num_key_value_heads={self.num_key_value_heads}",
        )
        check(
            0.0 < self.partial_rotary_factor <= 1.0,
            f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1]",
        )
        check(
            self.rotary_dim % 2 == 0 and self.rotary_dim > 0,
            f"rotary dim = int(head_dim={self.head_dim} * partial_rotary_factor="
            f"{self.partial_rotary_factor}) = {self.rotary_dim} must be even and positive",
        )
        check(
            self.num_experts_per_tok <= self.n_routed_experts,
            f"num_experts_per_tok={self.num_experts_per_tok} must be <= n_routed_experts={self.n_routed_experts}",
        )
        check(
            self.n_routed_experts % self.n_group == 0,
            f"n_routed_experts={self.n_routed_experts} must be divisible by n_group={self.n_group}",
        )
        check(self.topk_group <= self.n_group, f"topk_group={self.topk_group} must be <= n_group={self.n_group}")
        if self.n_group > 1 and self.n_routed_experts % self.n_group == 0:
            per_group = self.n_routed_experts // self.n_group
            check(
                per_group >= 2,
                f"group-limited routing scores each group by its top-2 experts: n_routed_experts="
                f"{self.n_routed_experts} / n_group={self.n_group} = {per_group} must be >= 2",
            )
            check(
                self.topk_group * per_group >= self.num_experts_per_tok,
                f"topk_group={self.topk_group} groups of {per_group} experts cannot hold "
                f"num_experts_per_tok={self.num_experts_per_tok}",
            )
        check(
            self.first_k_dense_replace <= self.num_hidden_layers,
            f"first_k_dense_replace={self.first_k_dense_replace} must be <= num_hidden_layers={self.num_hidden_layers}",
        )
        check(self.routed_scaling_factor > 0, f"routed_scaling_factor={self.routed_scaling_factor} must be > 0")
        check(self.rms_norm_eps > 0, f"rms_norm_eps={self.rms_norm_eps} must be > 0")
        check(self.rope_theta > 0, f"rope_theta={self.rope_theta} must be > 0")
        check(self.hidden_act == "silu", f"hidden_act={self.hidden_act!r}: only 'silu' (SwiGLU) is supported")
        check(
            not self.tie_word_embeddings,
            "tie_word_embeddings=True: GLM-4.5/4.6 use an untied lm_head, and MTP shares it",
        )
        special = [t for t in (self.pad_token_id, *self.eos_token_id) if t is not None]
        check(
            all(0 <= t < self.vocab_size for t in special),
            f"pad_token_id={self.pad_token_id} / eos_token_id={self.eos_token_id} must lie in "
            f"[0, vocab_size={self.vocab_size})",
        )
        if problems:
            raise ConfigError("invalid model config: " + "; ".join(problems))
