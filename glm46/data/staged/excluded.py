"""`prepare.keep_excluded=true`: every document a preparation drops, one line of `DIR/excluded/<reason>.jsonl`
(`quality/<rule>` in a folder of its own) with its reason, id, the file and line it came from, its score where a
model gave one, and its text: what datatrove's exclusion writers keep, so that a threshold can be read off the
documents it cost. Input that never became a document (a malformed line, a block of undecodable bytes) has no text:
its line names where it was and why (`detail`), and `count` inputs where one line stands for a block.

Each task writes the drops it decides into its own folder (`read`: unreadable, empty, max_chars; `tokenize`: the
verdicts of the quality rules, deduplication and the model-based filters); `finish` joins them in task order, which
is input order, so the files are the same for any number of tasks. Their counts add up to the manifest's `dropped`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

EXCLUDED = "excluded"


def write_excluded(folder: Path, records: list[dict]) -> None:
    """A task's dropped inputs, in the order it met them, into `folder/excluded/<reason>.jsonl`."""
    by_reason: dict[str, list[str]] = {}
    for record in records:
        by_reason.setdefault(record["reason"], []).append(json.dumps(record, ensure_ascii=False) + "\n")
    for reason, lines in by_reason.items():
        path = folder / EXCLUDED / f"{reason}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(lines))


def join_excluded(task_folders: list[Path], output: Path) -> dict[str, int]:
    """The tasks' excluded files joined, in the order of `task_folders`, into `output/excluded/` (replacing what it
    held); returns per reason the inputs its lines stand for."""
    shutil.rmtree(output / EXCLUDED, ignore_errors=True)
    counts: dict[str, int] = {}
    for folder in task_folders:
        for part in sorted((folder / EXCLUDED).rglob("*.jsonl")):
            reason = part.relative_to(folder / EXCLUDED).with_suffix("").as_posix()
            target = output / EXCLUDED / part.relative_to(folder / EXCLUDED)
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(part) as lines, open(target, "a") as joined:
                for line in lines:
                    joined.write(line)
                    counts[reason] = counts.get(reason, 0) + json.loads(line).get("count", 1)
    return counts
