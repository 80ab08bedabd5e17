"""Progress of the data loops that reads well on a terminal and in a file: a tqdm bar on a terminal; where stderr is
a file or a pipe (a Slurm log), whose carriage-return redraws would pile up into one line, a log line every
`every_s` seconds and one at the end (count, time, rate)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

log = logging.getLogger(__name__)
Item = TypeVar("Item")


def progress(
    items: Iterable[Item], desc: str, unit: str, total: int | None = None, every_s: float = 30.0
) -> Iterator[Item]:
    if sys.stderr.isatty():
        yield from tqdm(items, desc=desc, unit=unit, total=total, leave=False)
        return
    start = last = time.monotonic()
    count = 0
    of = f"/{total:,}" if total is not None else ""
    for count, item in enumerate(items, start=1):
        yield item
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            log.info(f"{desc}: {count:,}{of} {unit} ({count / (now - start):,.0f} {unit}/s)")
    took = time.monotonic() - start
    log.info(f"{desc}: {count:,} {unit} in {took:.1f} s ({count / max(took, 1e-9):,.0f} {unit}/s)")
