"""The house rules that code review would otherwise have to remember: no import circles between glm46's modules
(function-local imports included) nor between its packages (a floor imports only the floors below it), no two
modules with the same file name, the public names of DESIGN import, and a `_target_` node's schema is its
constructor's signature (glm46.config.schema.derive)."""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ConfigAttributeError, ValidationError

from glm46.config.schema.derive import target_schema

PACKAGE = Path(__file__).resolve().parents[1] / "glm46"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the glm46 modules it imports anywhere in its body (a `from a import b` names a.b if b is one)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph with each module in its package under glm46 (glm46.parallel.mesh -> glm46.parallel; a
    module on the ground floor, glm46.hf, stays itself)."""

    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        here = package(module)
        packages.setdefault(here, set()).update(package(t) for t in targets if package(t) != here)
    return packages


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_no_package_circles():
    assert cycles(package_graph(import_graph())) == []


def test_the_cycle_finder_finds_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_circle_through_two_packages_is_found_though_no_module_circle_is():
    modules = {"glm46.a.x": {"glm46.b.y"}, "glm46.b.y": set(), "glm46.b.z": {"glm46.a.w"}, "glm46.a.w": set()}
    assert cycles(modules) == []
    assert cycles(package_graph(modules)) == [["glm46.a", "glm46.b"]]


def test_no_two_modules_share_a_file_name():
    names = Counter(p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    assert [name for name, count in names.items() if count > 1] == []


def test_the_public_names_import():
    from glm46.estimate import count_parameters
    from glm46.hf import load_hf, save_hf
    from glm46.modules import GLM46Config, GLM46ForCausalLM
    from glm46.optim import Muon
    from glm46.optim.schedules import recipe_values

    assert all(callable(f) for f in (count_parameters, load_hf, save_hf, GLM46Config, GLM46ForCausalLM, Muon))
    assert callable(recipe_values)


@dataclass
class Ramp:
    start: float
    end: float = 1.0
    steps: int = 10
    note: str | None = None
    shape: tuple[int, int] = (2, 3)


def test_a_derived_schema_has_the_constructors_arguments_types_and_defaults():
    node = OmegaConf.structured(target_schema(Ramp, path="somewhere.Ramp"))
    assert OmegaConf.to_container(node) == {
        "_target_": "somewhere.Ramp",
        "start": MISSING,  # no default: the config must set it
        "end": 1.0,
        "steps": 10,
        "note": None,
        "shape": [2, 3],
    }
    node.steps = "12"  # converted, as OmegaConf does for an int field
    assert node.steps == 12
    with pytest.raises(ValidationError, match="steps"):
        node.steps = "many"
    with pytest.raises(ConfigAttributeError, match="stepz"):
        node.stepz = 3


def test_a_partial_schema_leaves_out_what_the_caller_passes():
    def build(params, lr: float = 0.1):
        return params, lr

    node = OmegaConf.structured(target_schema(build, path="x.build", partial=True, exclude=["params"]))
    assert OmegaConf.to_container(node) == {"_target_": "x.build", "_partial_": True, "lr": 0.1}
