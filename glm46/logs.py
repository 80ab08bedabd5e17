"""Status lines of the application: through `logging` (Hydra writes them to the console and the run
directory's <task>.log), from global rank zero only, so a 64-process job prints each line once; and the
dependencies' lines that are not the user's, dropped; and progress lines for long work outside the training loop
(evaluation's requests, an export's tensors)."""

from __future__ import annotations

import logging
import sys
import time
import warnings

from lightning.fabric.utilities.rank_zero import rank_zero_only


class _RankZeroOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(rank_zero_only, "rank", 0) == 0


def rank_zero_logger(name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankZeroOnly) for f in logger.filters):
        logger.addFilter(_RankZeroOnly())
    return logger


# What dependencies print on every run that asks nothing of a glm46 user. Python's own -W / PYTHONWARNINGS win: a
# user who sets them sees everything.
ADVERTISEMENTS = ("litlogger",)  # Lightning's tip for its hosted logger, on every Trainer
FOREIGN_WARNINGS = (
    # Lightning's hint when `srun` exists but the run is not under it: glm46 submits through submitit (the job runs
    # under srun); a run outside Slurm on a machine that has it is meant to be one.
    (r"The `srun` command is available on your system but is not used", Warning),
    # torch 2.13 deprecates LeafSpec, which Lightning 2.6's pytree helper still builds (lightning/pytorch/utilities/
    # _pytree.py); nothing a user can change.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
)


class _DropAdvertisements(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(word in record.getMessage() for word in ADVERTISEMENTS)


def quiet_dependencies() -> None:
    """Drop the dependencies' lines above from this process's output (idempotent)."""
    lightning_info = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropAdvertisements) for f in lightning_info.filters):
        lightning_info.addFilter(_DropAdvertisements())
    if not sys.warnoptions:
        for message, category in FOREIGN_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)


class Progress:
    """`Progress(log, "eval loglikelihood", total=400, unit="requests")`, then `advance(n)` as work completes:
    `eval loglikelihood: 128/400 requests (32%), 41.2/s, 7 s left` lines."""

    def __init__(self, log: logging.Logger, what: str, total: int, unit: str, every_s: float = 10.0):
        self.log, self.what, self.total, self.unit, self.every_s = log, what, total, unit, every_s
        self.done, self.started = 0, time.monotonic()
        self.last = self.started

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate else float("inf")
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        return f"{self.what}: {self.done}/{self.total} {self.unit}{share}, {rate:.1f}/s, " + (
            f"{left:.0f} s left" if self.done < self.total else f"done in {elapsed:.0f} s"
        )

    def advance(self, count: int = 1) -> None:
        self.done += count
        now = time.monotonic()
        if self.done >= self.total or now - self.last >= self.every_s:
            self.last = now
            self.log.info(self.line())
