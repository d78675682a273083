"""No import cycle between the modules of a package, and imports point one way between packages.

Read from the sources (ast), so every import counts: module level, inside functions and under
``TYPE_CHECKING``. ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
else to ``pkg`` (its ``__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGES_DIR = Path(__file__).resolve().parents[1] / "packages"
PACKAGES = {
    "ti_schema": "ti-schema",
    "ti_core": "ti-core",
    "ti_io": "ti-io",
    "ti_dist": "ti-dist",
    "ti_trainers": "ti-trainers",
    "ti_examples": "ti-examples",
}
ALLOWED = {
    "ti_schema": set(),
    "ti_core": {"ti_schema"},
    "ti_io": {"ti_schema"},
    "ti_dist": {"ti_schema"},
    "ti_trainers": {"ti_schema", "ti_core", "ti_io"},
    "ti_examples": {"ti_schema", "ti_core", "ti_io", "ti_trainers"},
}
"""Sibling packages each package's sources may import (a subset of what it declares)."""


def _modules(package: str) -> dict[str, Path]:
    root = PACKAGES_DIR / PACKAGES[package] / "src"
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module (of any package) that module ``name`` imports."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                found.add(submodule if submodule in known else target)
    return found


def _graph(package: str) -> dict[str, set[str]]:
    modules = _modules(package)
    known = set(modules)
    return {
        name: {m for m in _imports(name, path, known) if m in known and m != name}
        for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycle_between_modules(package: str) -> None:
    assert _cycles(_graph(package)) == []


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_packages_import_only_the_siblings_below_them(package: str) -> None:
    siblings = set(PACKAGES) - {package}
    imported = set()
    for name, path in _modules(package).items():
        imported |= {m.split(".")[0] for m in _imports(name, path, set())} & siblings
    assert imported <= ALLOWED[package], sorted(imported - ALLOWED[package])


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
