"""A run directory's own composition, restored from the directory alone.

`python run.py hydra.run.dir=R ckpt_path=last [more overrides]` resumes R: the overrides R was started with (its
`.hydra/overrides.yaml`, which Hydra writes into every run directory) are composed again, the new ones on top, so
that a resume never recomposes the default experiment because an original override was not typed again.
`python run.py task=eval eval.model=R` evaluates R likewise with the settings it was trained and evaluated with; an HF
directory (no .hydra/) is evaluated under experiment=evaluate, conf/eval's settings, not the default run's. Both say
what they restored. A key given anew replaces the saved override of that key (`optim=adamw` replaces a saved
`optim=muon`; `+phase.mixture.copy=0.2` a saved `+phase.mixture.copy=0.15`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml


def _key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def _value(overrides: list[str], key: str) -> str | None:
    values = [o.partition("=")[2] for o in overrides if _key(o) == key]
    return values[-1] if values else None


def saved_overrides(run_dir: str | Path) -> list[str] | None:
    """The overrides `run_dir` was composed with (its .hydra/overrides.yaml), or None where it has none."""
    file = Path(run_dir) / ".hydra" / "overrides.yaml"
    return [str(o) for o in yaml.safe_load(file.read_text()) or []] if file.is_file() else None  # not resolved


def _under(key: str, node: str) -> bool:
    return key == node or key.startswith(node + ".")


def on_top(saved: list[str], new: list[str]) -> list[str]:
    """The saved overrides whose keys `new` neither sets again nor removes (`~key`), then `new`; a `~key` that only
    removes what saved overrides added (`+key...`) goes with them, as there is nothing left for it to delete."""
    keys = {_key(o) for o in new if not o.startswith("~")}
    removed = [_key(o) for o in new if o.startswith("~")]
    kept = [o for o in saved if _key(o) not in keys and not any(_under(_key(o), node) for node in removed)]
    added = {node for node in removed if any(o.startswith("+") and _under(_key(o), node) for o in saved)}
    return kept + [o for o in new if not (o.startswith("~") and _key(o) in added)]


def restored_overrides(overrides: list[str]) -> list[str]:
    """`overrides` with the saved overrides of the run directory they resume (hydra.run.dir=R with ckpt_path) or
    evaluate (task=eval eval.model=R without an experiment=) put underneath; as they are otherwise."""
    if _value(overrides, "ckpt_path") and _value(overrides, "hydra.run.dir"):
        run_dir, what = _value(overrides, "hydra.run.dir"), "resuming"
    elif (
        _value(overrides, "task") == "eval"
        and _value(overrides, "eval.model")
        and _value(overrides, "experiment") is None
    ):
        run_dir, what = _value(overrides, "eval.model"), "evaluating"
    else:
        return list(overrides)
    saved = saved_overrides(run_dir)
    if saved is None:
        return ["experiment=evaluate", *overrides] if what == "evaluating" else list(overrides)
    kept = [o for o in saved if _key(o) not in {"task", "ckpt_path"} or what == "resuming"]
    restored = on_top(kept, overrides)
    print(
        f"{what} {run_dir}: its overrides ({Path(run_dir) / '.hydra' / 'overrides.yaml'}) restored: "
        f"{' '.join(kept) or '(none)'}; given now: {' '.join(overrides)}",
        file=sys.stderr,
        flush=True,
    )
    return restored
