"""Documents every machine has: the running Python's standard library, one module per document."""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}


def stdlib_documents(max_bytes: int | None = None) -> Iterator[tuple[str, str]]:
    """(relative path, source text) of the standard library's .py files, in a fixed order.

    Files that do not decode as UTF-8 are skipped; at most max_bytes of text in total.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if SKIP_DIRS.intersection(relative.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if max_bytes is not None and total + len(text) > max_bytes:
            return
        total += len(text)
        yield str(relative), text
