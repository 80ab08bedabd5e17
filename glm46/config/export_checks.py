"""task=serve, task=export and task=score: the export they read, what serving engines refuse in it, the llama.cpp they
need, the preference pairs a reward model scores."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from glm46.checkpoint import find_weights
from glm46.checkpoint.engine_limits import serving_problems
from glm46.checkpoint.hub_config import config_from_hf
from glm46.data.tokenizer import check_same_tokenizer
from glm46.errors import ConfigError
from glm46.modules import GLM46Config
from glm46.rl.reward_export import INFO_FILE as REWARD_INFO
from glm46.serve.command import VLLM_LORA_RANKS
from glm46.serve.llama_cpp import BUILD_SCRIPT as LLAMA_CPP_BUILD_SCRIPT
from glm46.serve.llama_cpp import llama_cpp_python


def exported_model(key: str, path: str | None, what: str) -> tuple[Path, dict, GLM46Config]:
    """The HF directory at `path` (itself, or a run directory's hf/), its config.json and model config; `key` names
    the setting in errors, `what` the task."""
    if path is None:
        raise ConfigError(f"{key}: no model to {what}; set {key}=<a run directory or an HF directory>")
    try:
        weights = find_weights(path)
        hf_config = json.loads((weights / "config.json").read_text())
        return weights, hf_config, config_from_hf(hf_config)
    except (FileNotFoundError, ValueError, TypeError, KeyError) as error:
        raise ConfigError(f"{key}={path}: {error}") from None


def check_serve(cfg: DictConfig) -> GLM46Config:
    """task=serve: an export that the engine, device and launch settings can serve; returns its model config."""
    settings = cfg.serve
    weights, _, config = exported_model("serve.model", settings.model, "serve")
    if settings.tensor_parallel_size < 1 or settings.speculative_steps < 1:
        raise ConfigError(
            f"serve.tensor_parallel_size={settings.tensor_parallel_size} and serve.speculative_steps="
            f"{settings.speculative_steps} must be >= 1"
        )
    problems = serving_problems(
        config, str(settings.engine), str(settings.device), settings.tensor_parallel_size, settings.mtp
    )
    if problems:
        where = f"serve.engine={settings.engine} serve.device={settings.device}: {weights} cannot be served: "
        raise ConfigError(where + "; ".join(problems))
    if settings.lora:
        check_served_adapter(settings)
    return config


def check_served_adapter(settings: DictConfig) -> None:
    """serve.lora: a peft-format adapter, of a rank vLLM takes, on an engine and device that serve GLM's MoE with it."""
    adapter = Path(settings.lora) / "adapter_config.json"
    if not adapter.is_file():
        raise ConfigError(f"serve.lora={settings.lora}: no {adapter.name} there (a PEFT run's <run dir>/adapter/)")
    if settings.engine != "vllm" or settings.device != "gpu":
        raise ConfigError(
            f"serve.lora with serve.engine={settings.engine} serve.device={settings.device}: adapters are served by "
            "vLLM on GPUs (its CPU build runs GLM's MoE layers with LoRA through a Triton kernel it does not have); "
            "serve the run's merged model instead (serve.model=<run dir>, whose hf/ has the adapters folded in)"
        )
    rank = json.loads(adapter.read_text()).get("r", 0)
    if not 0 < rank <= max(VLLM_LORA_RANKS):
        raise ConfigError(f"serve.lora={settings.lora}: rank r={rank}; vLLM serves ranks up to {max(VLLM_LORA_RANKS)}")


def check_export(cfg: DictConfig) -> GLM46Config:
    """task=export: an unquantized export to read, a new directory to write, a format built here."""
    settings = cfg.export
    weights, hf_config, config = exported_model("export.model", settings.model, "export")
    if hf_config.get("quantization_config"):
        raise ConfigError(
            f"export.model={settings.model}: {weights} is already quantized ({hf_config['quantization_config']}); "
            f"export the unquantized model"
        )
    if settings.output is None:
        raise ConfigError("export.output: no directory to write; set export.output=<a new directory>")
    output = Path(settings.output)
    if output.exists() and any(output.iterdir()):
        raise ConfigError(f"export.output={output} holds files: an export writes a new directory, never over one")
    if settings.format == "fp8" and settings.block_size < 1:
        raise ConfigError(f"export.block_size={settings.block_size} must be >= 1 (GLM-4.6-FP8: 128)")
    if settings.format == "gguf":
        if not (weights / "tokenizer.json").is_file():
            raise ConfigError(
                f"export.model={settings.model}: {weights} has no tokenizer.json, and a GGUF file carries its "
                f"tokenizer; export a run's model (its hf/ holds the tokenizer it was trained with)"
            )
        if settings.gguf_type == "q4_k_m" and llama_cpp(f"export.gguf_type={settings.gguf_type}") is None:
            raise ConfigError(
                f"export.gguf_type=q4_k_m is made by llama.cpp's quantizer, and no llama.cpp venv is built: run "
                f"bash {LLAMA_CPP_BUILD_SCRIPT} (or set GLM46_LLAMA_CPP_PYTHON), or export gguf_type=f16|q8_0"
            )
    return config


def llama_cpp(key: str) -> Path | None:
    """The llama.cpp venv's python (None: not built); a GLM46_LLAMA_CPP_PYTHON that does not exist is an error."""
    try:
        return llama_cpp_python()
    except FileNotFoundError as error:
        raise ConfigError(f"{key}: {error}") from None


def reward_model_export(key: str, path: str | None, what: str) -> tuple[Path, GLM46Config]:
    """exported_model's, for a reward model: ConfigError naming `key` when the export holds no reward head."""
    weights, _, config = exported_model(key, path, what)
    if not (weights / REWARD_INFO).is_file():
        raise ConfigError(
            f"{key}={path}: {weights} holds no reward model ({REWARD_INFO} is missing): train one with "
            f"module=reward_model"
        )
    return weights, config


def check_score(cfg: DictConfig) -> GLM46Config:
    """task=score: a reward model's export, a prepared preference dataset in the same tokenizer."""
    settings = cfg.score
    weights, config = reward_model_export("score.model", settings.model, "score")
    if settings.data is None:
        raise ConfigError("score.data: no pairs to score; set score.data=<a dataset prepared with source=preference>")
    data = Path(settings.data)
    if not (data / "tokens" / "shards.json").is_file():
        raise ConfigError(
            f"score.data={data}: no prepared dataset there ({data / 'tokens' / 'shards.json'} is missing)"
        )
    check_same_tokenizer(("score.model", weights / "tokenizer.json"), ("score.data", data / "tokenizer.json"))
    if settings.seq_len < 2 or settings.batch_size < 1 or not 0 < settings.val_fraction < 1:
        raise ConfigError(
            f"score.seq_len={settings.seq_len}, score.batch_size={settings.batch_size}, score.val_fraction="
            f"{settings.val_fraction}: need seq_len >= 2, batch_size >= 1 and 0 < val_fraction < 1"
        )
    return config
