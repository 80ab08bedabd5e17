"""Progress lines for long work outside the training loop (evaluation's requests, an export's tensors): what is done
of how much, the rate and the time left, at most every `every_s` seconds and once at the end, through a logger."""

from __future__ import annotations

import logging
import time


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
