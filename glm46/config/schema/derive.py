"""Schemas derived from their `_target_`: the keys and types of a node that builds an object are the arguments of
its constructor, declared once there. A new constructor argument is a new config key with nothing else to edit;
a key the constructor does not take is refused while composing, naming it (`callbacks.throughput.windw_size`).

The same idea as hydra-zen's `builds(target, populate_full_signature=True)`, in the few lines glm46 needs:
annotations become the types OmegaConf checks (anything it cannot check is `Any`), and defaults that are plain
values stay defaults; an argument without one is `???`, which the config must set.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field, make_dataclass
from dataclasses import fields as dataclass_fields
from enum import Enum
from typing import Any, List, Optional, Union

from omegaconf import MISSING

PLAIN = (int, float, str, bool)


def omegaconf_type(annotation: Any) -> Any:
    """The nearest type OmegaConf validates: plain values, enums, Optional and lists; else Any."""
    if annotation in PLAIN or (isinstance(annotation, type) and issubclass(annotation, Enum)):
        return annotation
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Union or str(origin) == "<class 'types.UnionType'>":
        rest = [a for a in args if a is not type(None)]
        inner = omegaconf_type(rest[0]) if len(rest) == 1 else Any
        return Optional[inner] if len(rest) < len(args) and inner is not Any else inner
    if origin in (list, tuple, Sequence, typing.get_origin(List[int])) or annotation in (list, tuple):
        same = args and (len(set(args)) == 1 or (len(args) == 2 and args[-1] is Ellipsis))  # tuple[int, ...] too
        item = omegaconf_type(args[0]) if same else Any
        return List[item]
    return Any  # dicts too: Hydra cannot override a typed dict that holds an interpolation (`${phase.mixture}`)


def _annotations(target: Callable) -> dict[str, Any]:
    """Parameter name -> annotation, each resolved on its own (one that names a TYPE_CHECKING import is Any)."""
    function = target.__init__ if inspect.isclass(target) else target
    names = getattr(function, "__globals__", {})
    resolved = {}
    for name, parameter in inspect.signature(target).parameters.items():
        annotation = parameter.annotation
        if isinstance(annotation, str):
            try:
                annotation = eval(annotation, dict(names), {"typing": typing})  # noqa: S307 - the target's own source
            except Exception:
                annotation = Any
        resolved[name] = Any if annotation is inspect.Parameter.empty else annotation
    return resolved


def target_schema(
    target: Callable,
    *,
    path: str | None = None,
    partial: bool = False,
    exclude: Sequence[str] = (),
    nested: Mapping[str, type] | None = None,
    base: type | None = None,
    name: str | None = None,
) -> type:
    """A dataclass schema for the node `{_target_: path, <target's arguments>}`.

    path: the `_target_` string (default: where the target is defined); partial: the node builds a
    `functools.partial` (`_partial_: true`), the caller passes `exclude`d arguments; nested: argument -> schema of
    a node inside this one; base: the schema of a node this one is merged over (Hydra merges a schema only over its
    own base classes: a WSD LR schedule over the default cosine's), whose arguments stay as that node set them;
    name: the schema's, as errors name it."""
    nested = dict(nested or {})
    annotations = _annotations(target)
    inherited = {f.name for f in dataclass_fields(base)} if base else set()
    fields: list[tuple] = [("_target_", str, field(default=path or f"{target.__module__}.{target.__qualname__}"))]
    if partial:
        fields.append(("_partial_", bool, field(default=True)))
    for argument, parameter in inspect.signature(target).parameters.items():
        if argument in exclude or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if argument in nested:
            fields.append((argument, nested[argument], field(default_factory=nested[argument])))
            continue
        kind, default = omegaconf_type(annotations[argument]), parameter.default
        if isinstance(default, (tuple, list)) and all(isinstance(item, PLAIN) for item in default):
            fields.append((argument, kind, field(default_factory=lambda value=list(default): list(value))))
            continue
        if argument in inherited:  # merged over the base's node: keep the values it holds (a merged ??? keeps them)
            fields.append((argument, kind, field(default=MISSING)))
            continue
        if default is parameter.empty or not (default is None or isinstance(default, PLAIN)):
            default = MISSING  # no default, or one a config cannot hold (a dtype, an object): the config sets it
        elif default is None and kind is not Any:
            kind = Optional[kind]
        fields.append((argument, kind, field(default=default)))
    return make_dataclass(name or f"{target.__name__}Schema", fields, bases=(base,) if base else ())
