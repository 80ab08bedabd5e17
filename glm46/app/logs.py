"""Status lines of the application: through `logging` (Hydra writes them to the console and the run
directory's <task>.log), from global rank zero only, so a 64-process job prints each line once."""

from __future__ import annotations

import logging

from lightning.fabric.utilities.rank_zero import rank_zero_only


class _RankZeroOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(rank_zero_only, "rank", 0) == 0


def rank_zero_logger(name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankZeroOnly) for f in logger.filters):
        logger.addFilter(_RankZeroOnly())
    return logger
