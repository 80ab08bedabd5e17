"""task=sample: the model it samples, the prompts it reads in the model's tokenizer, the reward model that ranks,
and the sample.* values that must hold together."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from glm46.data.tokenizer import check_same_tokenizer
from glm46.errors import ConfigError
from glm46.modules import GLM46Config

from .export_checks import exported_model, reward_model_export


def check_sample(cfg: DictConfig) -> GLM46Config:
    settings = cfg.sample
    weights, _, config = exported_model("sample.model", settings.model, "sample from")
    if settings.prompts is None:
        raise ConfigError("sample.prompts: no prompts; set sample.prompts=<a prepared dataset or a JSONL file>")
    prompts = Path(settings.prompts)
    if prompts.is_dir():
        if not (prompts / "tokens" / "shards.json").is_file():
            raise ConfigError(
                f"sample.prompts={prompts}: no prepared dataset there ({prompts / 'tokens' / 'shards.json'} is missing)"
            )
        check_same_tokenizer(
            ("sample.model", weights / "tokenizer.json"), ("sample.prompts", prompts / "tokenizer.json")
        )
    elif not prompts.is_file():
        raise ConfigError(f"sample.prompts={prompts}: no such file or directory")
    if settings.output is None:
        raise ConfigError("sample.output: where to write the samples; set sample.output=<a .jsonl file>")
    if settings.reward_model is not None:
        scorer, _ = reward_model_export("sample.reward_model", settings.reward_model, "rank with")
        check_same_tokenizer(
            ("sample.model", weights / "tokenizer.json"), ("sample.reward_model", scorer / "tokenizer.json")
        )
    elif settings.filters.min_reward is not None:
        raise ConfigError(
            f"sample.filters.min_reward={settings.filters.min_reward} needs a reward model: set sample.reward_model"
        )
    if min(settings.n, settings.batch_size, settings.tasks, settings.num_workers, settings.max_turns) < 1:
        raise ConfigError(
            f"sample.n={settings.n}, batch_size={settings.batch_size}, tasks={settings.tasks}, num_workers="
            f"{settings.num_workers} and max_turns={settings.max_turns} must be >= 1"
        )
    if settings.task is not None and not 0 <= settings.task < settings.tasks:
        raise ConfigError(f"sample.task={settings.task}: expected 0 <= task < sample.tasks={settings.tasks}")
    if settings.temperature < 0 or settings.max_new_tokens < 1:
        raise ConfigError(
            f"sample.temperature={settings.temperature} and max_new_tokens={settings.max_new_tokens}: need "
            f"temperature >= 0 and max_new_tokens >= 1"
        )
    if settings.pass_rate is not None and not (
        len(settings.pass_rate) == 2 and 0 <= settings.pass_rate[0] <= settings.pass_rate[1] <= 1
    ):
        raise ConfigError(
            f"sample.pass_rate={list(settings.pass_rate)}: expected [low, high] with 0 <= low <= high <= 1"
        )
    k = settings.fail_first_k
    if k is not None and (settings.pass_rate is None or not 1 <= k <= settings.n):
        raise ConfigError(
            f"sample.fail_first_k={k}: expected 1 <= k <= sample.n={settings.n}, with sample.pass_rate set (it narrows "
            f"the prompts the difficulty filter selects)"
        )
    return config
