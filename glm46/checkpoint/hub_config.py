"""The files beside the weights of a Hub checkpoint: config.json <-> GLM46Config, generation_config.json with GLM's
stop ids, and the tokenizer's files with the chat template, so that transformers, vLLM and SGLang load an export
with nothing beside it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from glm46.data.chat import CHAT_TEMPLATE, EOS, STOP_TOKENS
from glm46.modules import GLM46Config

from .engine_limits import serving_problems

if TYPE_CHECKING:
    from glm46.data.tokenizer import GLMTokenizer

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message lists the tensors."""


def config_from_hf(hf: dict) -> GLM46Config:
    """A GLM46Config from a Hub/transformers config.json (old top-level RoPE keys or v5 `rope_parameters`)."""
    if hf.get("model_type") not in (None, "glm4_moe"):
        raise CheckpointError(f"config.json: model_type={hf.get('model_type')!r}, expected 'glm4_moe'")
    rope = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise CheckpointError(f"config.json: rope type {rope_type!r} is not supported (only 'default' RoPE)")
    names = {f.name for f in fields(GLM46Config)}
    values = {k: v for k, v in hf.items() if k in names and v is not None}
    values["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    # transformers defaults partial_rotary_factor to 0.5 for glm4_moe when a config omits it
    values["partial_rotary_factor"] = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    values.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    values.setdefault("num_nextn_predict_layers", hf.get("num_mtp_layers", 0))
    if isinstance(values.get("eos_token_id"), int):
        values["eos_token_id"] = [values["eos_token_id"]]
    values.setdefault("pad_token_id", None)
    values.setdefault("eos_token_id", [])
    return GLM46Config(**values)


def config_to_hf(config: GLM46Config, dtype: torch.dtype) -> dict:
    """Hub-style config.json, readable by transformers, vLLM and SGLang."""
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        **asdict(config),
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def special_ids(config: GLM46Config, tokenizer: GLMTokenizer | None) -> tuple[int | None, list[int]]:
    """(pad id, stop ids): the config's, else GLM's (<|endoftext|>, <|user|>, <|observation|>) in `tokenizer`.
    A config whose ids differ from the tokenizer's is logged: an engine would stop at the config's."""
    if tokenizer is None:
        return config.pad_token_id, list(config.eos_token_id)
    stops = [tokenizer.token_id(token) for token in STOP_TOKENS]
    pad = tokenizer.token_id(EOS)
    if config.eos_token_id and sorted(config.eos_token_id) != sorted(stops):
        log.warning(
            "model.eos_token_id=%s differs from the tokenizer's stop tokens %s=%s; the export keeps the config's",
            config.eos_token_id,
            list(STOP_TOKENS),
            stops,
        )
    return (config.pad_token_id, list(config.eos_token_id)) if config.eos_token_id else (pad, stops)


def write_configs(config: GLM46Config, dtype: torch.dtype, path: Path, tokenizer: GLMTokenizer | None) -> None:
    """config.json, generation_config.json and (with `tokenizer`) tokenizer.json + tokenizer_config.json."""
    pad, stops = special_ids(config, tokenizer)
    hub = config_to_hf(config, dtype) | {"pad_token_id": pad, "eos_token_id": stops}
    (path / "config.json").write_text(json.dumps(hub, indent=2))
    generation = {"_from_model_config": True, "pad_token_id": pad, "eos_token_id": stops}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if tokenizer is not None:
        tokenizer.save(path / "tokenizer.json")  # a Hub tokenizer's own tokenizer_config.json comes with it, as it is
        if "tokenizer_config.json" not in tokenizer.hub_files:
            (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(config), indent=2))
    for problem in serving_problems(config):
        log.warning("%s: %s", path, problem)


def tokenizer_config(config: GLM46Config) -> dict:
    """tokenizer_config.json for transformers' fast tokenizer over our tokenizer.json, as GLM-4.6's names its
    special tokens (pad = eos = <|endoftext|>, left padding), with our chat template (glm46.data.chat)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
