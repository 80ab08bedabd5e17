"""The key-by-key difference between two compositions: `python -m glm46.diff A B`.

A and B are each a quoted override list (`"experiment=pretrain_phase1 optim=adamw"`; `""` is the
default composition) or a run directory (a Hydra output directory holding `.hydra/config.yaml` and
`.hydra/hydra.yaml`). Both sides are resolved (the project's resolvers included) and compared leaf
by leaf, and their config-group choices (`hydra.runtime.choices`) are compared as "defaults".

    python -m glm46.diff "experiment=pretrain_phase1" "experiment=pretrain_phase1 optim=adamw"
    python -m glm46.diff outputs/train/<job id> "optim=adamw" --yaml

Exit status: 0 whether or not they differ (1 with `--exit-code` when they do), 2 when a side
cannot be composed (a bad override, a missing run directory), with Hydra's message. Two run directories also get
their outcomes side by side (final train loss, validation loss, tokens/s, lm-eval metrics) under the differences.

Not compared: the `hydra` node itself (only its choices), and `${hydra:...}` interpolations, which
are kept unresolved on both sides: they name the run's own output directory, which differs between
any two runs and is unknown before one.
"""

from __future__ import annotations

import argparse
import enum
import math
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from glm46.config.aliases import renamed_overrides
from glm46.config.schema import register_configs
from glm46.run_files import is_run_dir as run_directory

CONFIG_DIR = Path(__file__).resolve().parents[2] / "conf"
_ABSENT = object()
NODE_REFERENCE = re.compile(r"\$\{[\w.]+\}")  # `${group.key}`: a whole node of another group


class SpecError(Exception):
    """A side that cannot be composed or read; the message says which and why."""


# --- composing and reading a side -------------------------------------------------------------


def default_config_dir() -> Path:
    """The repository's conf/ next to the package (an editable install), else ./conf."""
    if (CONFIG_DIR / "config.yaml").is_file():
        return CONFIG_DIR
    return Path.cwd() / "conf"


def is_run_dir(spec: str) -> bool:
    return bool(spec.strip()) and run_directory(Path(spec))


def compose_from(spec: str, config_dir: str | Path | None = None) -> tuple[dict, dict]:
    """(resolved config without the `hydra` node, group choices) of an override list or a run directory.

    Raises SpecError, with Hydra's message, for an override list that does not compose.
    """
    register_configs()
    if is_run_dir(spec):
        return _read_run_dir(Path(spec))
    if spec.strip() and "=" not in spec and ("/" in spec or Path(spec).exists()):
        raise SpecError(
            f"{spec}: not a run directory (no {Path(spec) / '.hydra' / 'config.yaml'}) nor an override list"
        )
    try:
        overrides = renamed_overrides(shlex.split(spec))
    except ValueError as e:
        raise SpecError(f"cannot split the override list {spec!r}: {e}") from None
    config_dir = Path(config_dir) if config_dir is not None else default_config_dir()
    if not (config_dir / "config.yaml").is_file():
        raise SpecError(f"no config.yaml in {config_dir} (pass --config-dir)")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException, OSError, ValueError) as e:
        raise SpecError(f"cannot compose {spec!r}: {_message(e)}") from None
    finally:
        GlobalHydra.instance().clear()
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    return _resolved(cfg), choices


def _read_run_dir(run_dir: Path) -> tuple[dict, dict]:
    """A run directory's config as it ran (.hydra/config.yaml) and its choices (.hydra/hydra.yaml)."""
    hydra_dir = run_dir / ".hydra"
    try:
        cfg = OmegaConf.load(hydra_dir / "config.yaml")
        hydra_yaml = hydra_dir / "hydra.yaml"
        if hydra_yaml.is_file():
            hydra_cfg = OmegaConf.load(hydra_yaml).hydra
            choices = OmegaConf.to_container(hydra_cfg.runtime.choices)
            cfg.hydra = hydra_cfg
        else:
            choices = {}
    except (OmegaConfBaseException, OSError, yaml.YAMLError) as e:
        raise SpecError(f"cannot read the run directory {run_dir}: {_message(e)}") from None
    return _resolved(cfg), choices


def _message(e: BaseException) -> str:
    """The exception's message and those of its causes (Hydra wraps the detail in __cause__)."""
    parts = []
    while e is not None and len(parts) < 5:
        text = str(e).strip()
        if text and text != "None" and not any(text in part for part in parts):
            parts.append(text)
        if isinstance(e, OmegaConfBaseException):  # it names the key; its causes add nothing
            break
        e = e.__cause__
    return "\n".join(parts)


# --- resolving, leaf by leaf ------------------------------------------------------------------


def _resolved(cfg: DictConfig) -> dict:
    """The config as plain data, resolved key by key; the `hydra` node left out.

    A key whose interpolation does not resolve (or names `${hydra:...}`) keeps its unresolved text;
    a missing value stays `???`.
    """
    return {str(k): _resolve_child(cfg, k) for k in cfg if k != "hydra"}


def _resolve_node(node: DictConfig | ListConfig) -> Any:
    if node._is_none():
        return None
    if node._is_missing():
        return "???"
    if isinstance(node, DictConfig):
        return {str(k): _resolve_child(node, k) for k in node}
    return [_resolve_child(node, i) for i in range(len(node))]


def _resolve_child(node: DictConfig | ListConfig, key: Any) -> Any:
    child = node._get_node(key)
    raw = child._value()
    if isinstance(raw, str) and "${hydra:" in raw:
        return raw
    if child._is_missing():
        return "???"
    try:
        value = node[key]
    except Exception:  # noqa: BLE001 - any failure to resolve: show the key as written
        if isinstance(child, (DictConfig, ListConfig)) and not isinstance(raw, str):
            return OmegaConf.to_container(child, resolve=False)
        return raw
    if isinstance(value, (DictConfig, ListConfig)):
        if isinstance(raw, str) and NODE_REFERENCE.fullmatch(raw):
            return raw  # another node, passed on (`module.optimizer: ${optim.optimizer}`): its keys differ there
        return _resolve_node(value)
    if isinstance(value, enum.Enum):
        return value.name
    return value


# --- the difference ---------------------------------------------------------------------------


def flatten(cfg: dict, prefix: str = "") -> dict[str, Any]:
    """{dotted key: leaf}; lists and empty dicts are leaves."""
    out = {}
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _same(x: Any, y: Any) -> bool:
    """Equal values of the same type (1 is not 1.0 nor True, "32" is not 32)."""
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if type(x) is not type(y):
        return False
    if isinstance(x, float) and math.isnan(x) and math.isnan(y):
        return True
    return x == y


def diff_configs(a: dict, b: dict) -> dict[str, dict[str, Any]]:
    """{dotted key: {"a": value, "b": value}} for every leaf that differs, sorted by key.

    A key present on one side only has only that side's entry ("a" only: removed; "b" only: added).
    """
    flat_a, flat_b = flatten(a), flatten(b)
    changed = {}
    for key in sorted(flat_a.keys() | flat_b.keys()):
        va, vb = flat_a.get(key, _ABSENT), flat_b.get(key, _ABSENT)
        if va is not _ABSENT and vb is not _ABSENT and _same(va, vb):
            continue
        entry = {}
        if va is not _ABSENT:
            entry["a"] = va
        if vb is not _ABSENT:
            entry["b"] = vb
        changed[key] = entry
    return changed


def diff_specs(spec_a: str, spec_b: str, config_dir: str | Path | None = None) -> dict:
    """{"defaults": choice differences, "changed": key differences} of two specs; and when both are run directories,
    "outcomes": {outcome: {"a", "b"}} for every outcome either run has (glm46.reports.sweep_summary.read_outcomes)."""
    cfg_a, choices_a = compose_from(spec_a, config_dir)
    cfg_b, choices_b = compose_from(spec_b, config_dir)
    result = {"defaults": diff_configs(choices_a, choices_b), "changed": diff_configs(cfg_a, cfg_b)}
    if is_run_dir(spec_a) and is_run_dir(spec_b):
        from glm46.reports.sweep_summary import read_outcomes

        a, b = read_outcomes(Path(spec_a)), read_outcomes(Path(spec_b))
        result["outcomes"] = {
            name: {side: values[name] for side, values in (("a", a), ("b", b)) if name in values}
            for name in dict.fromkeys([*a, *b])
        }
    return result


# --- output -----------------------------------------------------------------------------------


def _show(value: Any) -> str:
    """A value as YAML flow text on one line (strings that look like numbers stay quoted)."""
    if value is _ABSENT:
        return "(absent)"
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf, sort_keys=False).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def format_text(result: dict, label_a: str = "A", label_b: str = "B") -> str:
    lines = [f"--- a: {label_a!r}", f"+++ b: {label_b!r}"]
    for section, title in (("defaults", "defaults"), ("changed", "keys")):
        entries = result[section]
        added = sum("a" not in e for e in entries.values())
        removed = sum("b" not in e for e in entries.values())
        counts = [
            f"{n} {what}"
            for n, what in ((len(entries) - added - removed, "changed"), (added, "added"), (removed, "removed"))
            if n
        ]
        lines.append(f"{title} ({', '.join(counts)}):" if entries else f"{title}: no difference")
        for key, entry in entries.items():
            lines.append(f"  {key}: {_show(entry.get('a', _ABSENT))} -> {_show(entry.get('b', _ABSENT))}")
    if "outcomes" in result:
        lines.append("outcomes (b - a):" if result["outcomes"] else "outcomes: none recorded")
        for name, entry in result["outcomes"].items():
            a, b = entry.get("a"), entry.get("b")
            delta = f" ({b - a:+.4g})" if a is not None and b is not None else ""
            lines.append(f"  {name}: {_outcome(a)} -> {_outcome(b)}{delta}")
    return "\n".join(lines)


def _outcome(value: float | None) -> str:
    return "(absent)" if value is None else f"{value:.4g}"


def format_yaml(result: dict) -> str:
    return yaml.safe_dump(result, sort_keys=False, default_flow_style=False, width=120)


# --- command line -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m glm46.diff",
        description="The key-by-key difference between two resolved compositions. "
        'A and B: a quoted override list ("" for the default) or a run directory.',
    )
    parser.add_argument("a", help='override list, e.g. "experiment=pretrain_phase1", or a run directory')
    parser.add_argument("b", help="override list or run directory")
    parser.add_argument(
        "--yaml", action="store_true", help="print {defaults: {group: {a, b}}, changed: {key: {a, b}}} as YAML"
    )
    parser.add_argument("--exit-code", action="store_true", help="exit with 1 when they differ, 0 when not")
    parser.add_argument("--config-dir", default=None, help=f"the config directory (default {default_config_dir()})")
    args = parser.parse_args(argv)

    try:
        result = diff_specs(args.a, args.b, args.config_dir)
    except SpecError as e:
        print(f"glm46.diff: {e}", file=sys.stderr)
        return 2
    if args.yaml:
        sys.stdout.write(format_yaml(result))
    else:
        print(format_text(result, args.a, args.b))
    differ = bool(result["defaults"] or result["changed"])
    return 1 if args.exit_code and differ else 0
