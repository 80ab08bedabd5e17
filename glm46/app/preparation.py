"""`task=prepare` from a composition (its `source`), and the dataset a training run prepares first."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from glm46.app.logs import rank_zero_logger
from glm46.data.cache import is_prepared, mark_prepared, prepare_fingerprint
from glm46.data.pipeline import prepare_dataset
from glm46.errors import ConfigError

log = rank_zero_logger(__name__)


def prepare_source(source: DictConfig, settings: DictConfig) -> dict:
    """Prepare a `source` (source=embedded|jsonl|text|parquet) with the `prepare` settings."""
    return prepare_dataset(
        source.reader,
        list(source.paths),
        source.output_dir,
        default_domain=source.default_domain,
        options=OmegaConf.to_container(source.options) if source.options else None,
        dedup=OmegaConf.to_container(settings.dedup),
        quality=instantiate(settings.quality, _convert_="all"),
        tokenizer_path=settings.tokenizer.path,
        vocab_size=settings.tokenizer.vocab_size,
        num_workers=settings.num_workers,
    )


def prepare_cached(
    source: DictConfig, settings: DictConfig, prepare: Callable[[DictConfig, DictConfig], object] = prepare_source
) -> None:
    """Build the dataset of `source` with the `prepare` settings, unless its output_dir already holds it with the
    same fingerprint (glm46.data.cache). `prepare(source, settings)` builds it (tests pass their own)."""
    output_dir = Path(source.output_dir)
    fingerprint = prepare_fingerprint(
        OmegaConf.to_container(source, resolve=True), OmegaConf.to_container(settings, resolve=True)
    )
    if is_prepared(output_dir, fingerprint):
        log.info(f"dataset: {output_dir} (prepared, fingerprint {fingerprint})")
        return
    if int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))) > 1:
        raise ConfigError(
            f"source: {output_dir} is not prepared (fingerprint {fingerprint}) and this is one "
            f"of several processes: prepare it first with task=prepare, or run once in one process"
        )
    log.info(f"dataset: preparing {output_dir} (first use, or its sources or settings changed)")
    prepare(source, settings)
    mark_prepared(output_dir, fingerprint)


def prepare_once(cfg: DictConfig, prepare: Callable[[DictConfig, DictConfig], object] = prepare_source) -> None:
    """Before training: build the `source` dataset when the training data reads its output_dir (the default run),
    reused while its fingerprint holds. A run on another dataset (data.path elsewhere, or data=stdlib) never
    writes there, nor into its own."""
    if cfg.get("source") is None or "path" not in cfg.data:
        return
    if Path(cfg.data.path).absolute() == Path(cfg.source.output_dir).absolute():
        prepare_cached(cfg.source, cfg.prepare, prepare)
