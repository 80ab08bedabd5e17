"""What `peft=lora|dora` needs of the rest of the run, checked at composition: its own settings, a layout that trains
adapters, a precision its base dtype can compute in, an adapter to start from that exists, and the trainable tokens
in init_from's tokenizer."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from glm46.errors import ConfigError
from glm46.modules import GLM46Config
from glm46.peft.peft_format import CONFIG_FILE, WEIGHTS_FILE
from glm46.peft.settings import peft_settings
from glm46.peft.token_rows import trainable_token_ids

from .dataset_info import weights_folder


def check_peft(cfg: DictConfig, config: GLM46Config) -> None:
    settings = peft_settings(cfg)
    if settings is None:
        return
    parallelism = cfg.parallelism
    if parallelism.engine == "deepspeed":
        raise ConfigError(f"peft={settings.method} under DeepSpeed: use parallelism=ddp|fsdp2|ep|fsdp2_ep")
    if settings.experts == "shared" and parallelism.expert_parallel > 1 and "experts" in settings.target_names():
        raise ConfigError(
            f"peft.experts=shared under parallelism.expert_parallel={parallelism.expert_parallel}: one pair for a "
            "layer's experts would span the expert-parallel ranks; use peft.experts=per_expert (each rank holds its "
            "own experts' pairs)"
        )
    if settings.base_dtype in ("bfloat16", "fp8") and not str(cfg.trainer.precision).startswith("bf16"):
        raise ConfigError(
            f"peft.base_dtype={settings.base_dtype} with trainer.precision={cfg.trainer.precision}: a "
            f"{settings.base_dtype} base computes under bf16 precision (trainer.precision=bf16-mixed); or keep "
            "peft.base_dtype=float32"
        )
    if settings.base_dtype == "fp8":
        check_fp8_base(cfg)
    if settings.adapter:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (Path(settings.adapter) / name).is_file():
                raise ConfigError(
                    f"peft.adapter={settings.adapter}: no {name} there (an adapter in peft's format, as a PEFT run "
                    "writes to <run dir>/adapter/)"
                )
    weights = weights_folder(cfg.get("init_from"))
    if settings.trainable_tokens and weights is not None:  # a curriculum's later stage is checked when it starts
        try:
            trainable_token_ids(settings, weights)
        except ValueError as error:
            raise ConfigError(str(error)) from None


def check_fp8_base(cfg: DictConfig) -> None:
    """A block-FP8 base (glm46.peft.fp8_base) is read from an HF folder and is split by any layout but tensor
    parallelism, whose split layers compute with the weight itself."""
    init_from = cfg.get("init_from")
    if not init_from or Path(str(init_from)).suffix == ".ckpt":
        raise ConfigError(
            f"peft.base_dtype=fp8 with init_from={init_from}: the FP8 base is read from an HF folder (GLM's released "
            "weights, FP8 or bf16, or a run's hf/ export); set init_from to one"
        )
    if cfg.parallelism.tensor_parallel > 1:
        raise ConfigError(
            f"peft.base_dtype=fp8 under parallelism.tensor_parallel={cfg.parallelism.tensor_parallel}: tensor "
            "parallelism's split layers compute with the weight itself, not its FP8 values and scales; use "
            "peft.base_dtype=bfloat16, or a layout without TP (FSDP2, EP and PP split an FP8 base)"
        )
