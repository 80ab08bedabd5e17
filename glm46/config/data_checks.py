"""The data against the model and the phase: the dataset's domains, sequence length, packing; a preparation's tasks."""

from __future__ import annotations

import json
from pathlib import Path

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from glm46.data.staged.filter_checks import check_filters
from glm46.data.staged.work import plan_for
from glm46.data.tokenizer import check_same_tokenizer
from glm46.data.windows import check_mixture_domains, check_packing_choice
from glm46.errors import ConfigError
from glm46.lit.sft_data import SFTDataModule, check_packing
from glm46.modules import GLM46Config

from .dataset_info import checkpoint_config, prepared_index, weights_folder
from .values import value_at


def _prepared_domains(cfg: DictConfig) -> set[str] | None:
    """The domains of the prepared dataset at data.path (its tokens/shards.json), when it is on this machine and
    not one the run prepares itself (its `source`); None otherwise (an unreadable index is the DataModule's to
    report)."""
    path = value_at(cfg, "data.path")
    if not path:
        return None
    source = cfg.get("source")
    if source and Path(str(source.output_dir)).absolute() == Path(path).absolute():
        return None
    try:
        return set(json.loads((Path(path) / "tokens" / "shards.json").read_text())["domains"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_data(cfg: DictConfig, config: GLM46Config) -> None:
    data = cfg.data
    seq_len = data.get("seq_len")
    if seq_len is not None and seq_len > config.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len={seq_len} exceeds model.max_position_embeddings={config.max_position_embeddings}"
        )
    if data.get("packing") is not None:
        check_packing_choice(data.packing)
    module = get_class(data._target_) if "_target_" in data else None
    if module is not None and issubclass(module, SFTDataModule):
        check_packing(data.packing)
    if data.get("mixture") is None:
        return
    mixture = OmegaConf.to_container(OmegaConf.create({"m": data.mixture}), resolve=True)["m"]  # a resolver's dict too
    for domain, weight in mixture.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
            raise ConfigError(f"data.mixture.{domain}={weight!r} (phase.mixture) must be a number >= 0")
    if not sum(mixture.values()) > 0:
        raise ConfigError(f"data.mixture={mixture} (phase.mixture) gives no domain a positive weight")
    domains = _prepared_domains(cfg)
    if domains is not None:
        check_mixture_domains(mixture, domains, data.path)
    if data.get("replay"):
        check_replay(data)


# The fields of a checkpoint's config.json that its weights fix: their shapes, and what their numbers mean (routing,
# the rotary share of each head, the norms). RoPE's base and the context length may change between stages
# (mid-training sets both).
ARCHITECTURE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "n_shared_experts",
    "first_k_dense_replace",
    "num_nextn_predict_layers",
    "attention_bias",
    "use_qk_norm",
    "tie_word_embeddings",
    "num_experts_per_tok",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "partial_rotary_factor",
    "rms_norm_eps",
    "hidden_act",
)


def check_vocabulary(cfg: DictConfig, config: GLM46Config) -> None:
    """The data, `init_from` and the model speak one vocabulary: the data's tokenizer fits model.vocab_size,
    init_from's config.json has the model's shapes, and the data was prepared with init_from's tokenizer (each where
    its files exist: a curriculum's later stages are checked when they start)."""
    path = value_at(cfg, "data.path")
    data_tokenizer = Path(str(path)) / "tokenizer.json" if path else None
    if data_tokenizer is not None and data_tokenizer.is_file():
        tokens = prepared_index(path)["vocab_size"]
        if tokens > config.vocab_size:
            raise ConfigError(
                f"data.path={path}: its tokenizer ({data_tokenizer}) has {tokens} tokens, more than "
                f"model.vocab_size={config.vocab_size}; set model.vocab_size >= {tokens}, or leave it unset in a "
                f"one-stage run (data=shards|sft|rl|preference), which takes the data's"
            )
    weights = weights_folder(cfg.get("init_from"))
    if weights is None:
        return
    saved = checkpoint_config(cfg.init_from)
    differ = [
        f"{k}: {getattr(saved, k)} there, {getattr(config, k)} here"
        for k in ARCHITECTURE_FIELDS
        if getattr(saved, k) != getattr(config, k)
    ]
    if differ:
        raise ConfigError(
            f"init_from={cfg.init_from}: its config.json ({weights / 'config.json'}) differs from the composed model "
            f"(model.*) in {'; '.join(differ)}: use model=auto (its architecture), or the model= it was trained as"
        )
    if data_tokenizer is not None and data_tokenizer.is_file() and (weights / "tokenizer.json").is_file():
        check_same_tokenizer(("init_from", weights / "tokenizer.json"), ("data.path", data_tokenizer))


def check_replay(data: DictConfig) -> None:
    """data.replay: a prepared dataset in data.path's tokenizer, holding the domains of its mixture (each replay
    path that exists already; a curriculum's later stages are checked when they read it)."""
    replay = Path(str(data.replay.path))
    if not replay.exists() or not Path(str(data.path)).exists():
        return
    if replay.resolve() != Path(str(data.path)).resolve():  # else its own pre-training text (data=embedded_sft)
        check_same_tokenizer(
            ("data.path", Path(str(data.path)) / "tokenizer.json"), ("data.replay.path", replay / "tokenizer.json")
        )
    mixture = OmegaConf.to_container(data.replay.mixture, resolve=True)
    try:
        domains = json.loads((replay / "tokens" / "shards.json").read_text())["domains"]
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"data.replay.path={replay}: no prepared dataset there ({error})") from None
    check_mixture_domains(mixture, domains, replay)


def check_prepare(cfg: DictConfig) -> None:
    """prepare.tasks and prepare.tokenizer.max_digits: at least 1; the embedded corpus's sft_tool_share: a share;
    the model-based filters' settings and model files (glm46.data.staged.filter_checks);
    over several tasks, the staged plan must be possible (glm46.data.staged.work: the input exists, holds no fewer
    files than tasks, and the output directory holds no other preparation)."""
    if cfg.prepare.tasks < 1:
        raise ConfigError(f"prepare.tasks={cfg.prepare.tasks}: the number of tasks of each stage is at least 1")
    if cfg.prepare.tokenizer.max_digits < 1:
        raise ConfigError(
            f"prepare.tokenizer.max_digits={cfg.prepare.tokenizer.max_digits}: a token holds at least one digit"
        )
    share = (cfg.source.get("options") or {}).get("sft_tool_share")
    if share is not None and not 0 <= share <= 1:
        raise ConfigError(f"source.options.sft_tool_share={share}: a share of the sft conversations, from 0 to 1")
    check_filters(OmegaConf.to_container(cfg.prepare, resolve=True))
    if cfg.prepare.tasks > 1:
        plan_for(*(OmegaConf.to_container(node, resolve=True) for node in (cfg.source, cfg.prepare)))
