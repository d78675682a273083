"""Imports point one way: between packages, between the parts of a package, between modules.

Read from the sources (ast), so every import counts: module level, inside functions and under
``TYPE_CHECKING``. ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
else to ``pkg`` (its ``__init__``); ``import a.b.c`` is an edge to the deepest of those that is
a module. The implicit import of a module's parent packages is not an edge: every submodule has
it, and it is how packages work.

Three rules, each over every package:

- no cycle between modules;
- no cycle between the parts of any (sub)package, its direct submodules and subpackages, each
  taken with everything inside it: ``ti_core.capture`` importing ``ti_core.compiled`` while
  ``ti_core.compiled`` imports ``ti_core.capture`` runs back up even when no two modules import
  each other;
- a package imports only the siblings below it (``ALLOWED``), and the layers of ti-core only
  the layers below them (``FORBIDDEN``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
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
    "ti_dist": {"ti_schema", "ti_io"},
    "ti_trainers": {"ti_schema", "ti_core", "ti_io"},
    "ti_examples": {"ti_schema", "ti_core", "ti_io", "ti_trainers"},
}
"""Sibling packages each package's sources may import (a subset of what it declares)."""
FORBIDDEN = {
    "ti_core.reduction": (
        "ti_core.capture",
        "ti_core.emission",
        "ti_core.sentinel",
        "ti_core.gate",
        "ti_core.observer",
        "ti_core.api",
    ),
    "ti_core.capture": (
        "ti_core.emission",
        "ti_core.sentinel",
        "ti_core.gate",
        "ti_core.observer",
        "ti_core.api",
    ),
    "ti_core.emission": (
        "ti_core.capture",
        "ti_core.sentinel",
        "ti_core.gate",
        "ti_core.observer",
        "ti_core.api",
    ),
    "ti_core.sentinel": (
        "ti_core.capture",
        "ti_core.emission",
        "ti_core.gate",
        "ti_core.observer",
        "ti_core.api",
    ),
    "ti_core.gate": ("ti_core.observer", "ti_core.api"),
    "ti_core.observer": ("ti_core.api",),
}
"""What each layer of ti-core must not import (docs/architecture.md): capture, emission and the
flight recorder are peers (none imports another) over reduction, which knows none of them; the
gate drives capture and the recorder, the observer composes them all, the api builds the
observer."""
MAX_FLOORS = 6
"""How deep ti-core's parts may stack (docs/architecture.md, "ti-core's floors"): the longest
chain of imports between its direct submodules and subpackages, its front door
(``ti_core/__init__.py``, re-exports only) left out."""


def _modules(package: str, packages_dir: Path = PACKAGES_DIR) -> dict[str, Path]:
    """Every module of ``package`` by dotted name (a package by its ``__init__``)."""
    root = packages_dir / PACKAGES[package] / "src"
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module (of any package) that module ``name`` imports; a module of ``known`` by its
    name there."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in known and "." in target:
                    target = target.rpartition(".")[0]
                found.add(target if target in known else alias.name)
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
    found.discard(name)
    return found


def _graph(package: str, packages_dir: Path = PACKAGES_DIR) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    modules = _modules(package, packages_dir)
    known = set(modules)
    return {
        name: {m for m in _imports(name, path, known) if m in known}
        for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
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


def _part_of(module: str, package: str) -> str | None:
    """The direct submodule or subpackage of ``package`` that ``module`` is or lies in; None
    when it lies outside ``package`` or is its ``__init__``."""
    if not module.startswith(package + "."):
        return None
    return f"{package}.{module[len(package) + 1 :].split('.')[0]}"


def _part_graph(
    graph: dict[str, set[str]], package: str
) -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    """The parts of ``package`` (its direct submodules and subpackages, each with everything
    inside it), the parts each imports, and the module imports behind each part edge."""
    parts: dict[str, set[str]] = {}
    why: dict[tuple[str, str], list[str]] = {}
    for module, targets in graph.items():
        source = _part_of(module, package)
        if source is None:
            continue
        parts.setdefault(source, set())
        for target in targets:
            part = _part_of(target, package)
            if part is not None and part != source:
                parts[source].add(part)
                parts.setdefault(part, set())
                why.setdefault((source, part), []).append(f"{module} -> {target}")
    return parts, why


def _part_cycles(graph: dict[str, set[str]], packages: Iterable[str]) -> list[str]:
    """For each package of ``packages``: the cycles between its parts (its direct submodules
    and subpackages, each with everything inside it), each with the module imports behind it."""
    problems: list[str] = []
    for package in sorted(packages):
        parts, why = _part_graph(graph, package)
        for cycle in _cycles(parts):
            members = set(cycle)
            edges = sorted(
                edge
                for (a, b), imports in why.items()
                if a in members and b in members
                for edge in imports
            )
            problems.append(f"{package}: {' <-> '.join(cycle)} ({'; '.join(edges)})")
    return problems


def _chains(parts: dict[str, set[str]]) -> dict[str, list[str]]:
    """For each of ``parts`` (an acyclic part graph), the longest chain of imports down from
    it, itself first: its floor is the chain's length."""
    chains: dict[str, list[str]] = {}

    def chain(part: str) -> list[str]:
        if part not in chains:
            below = [chain(target) for target in sorted(parts[part])]
            chains[part] = [part, *max(below, key=len, default=[])]
        return chains[part]

    for part in sorted(parts):
        chain(part)
    return chains


def _packages(package: str, packages_dir: Path = PACKAGES_DIR) -> set[str]:
    """``package`` and each of its subpackages."""
    return {
        name for name, path in _modules(package, packages_dir).items() if path.name == "__init__.py"
    }


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycle_between_modules(package: str) -> None:
    assert _cycles(_graph(package)) == []


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycle_between_the_parts_of_a_package(package: str) -> None:
    assert _part_cycles(_graph(package), _packages(package)) == []


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_packages_import_only_the_siblings_below_them(package: str) -> None:
    siblings = set(PACKAGES) - {package}
    imported = set()
    for name, path in _modules(package).items():
        imported |= {m.split(".")[0] for m in _imports(name, path, set())} & siblings
    assert imported <= ALLOWED[package], sorted(imported - ALLOWED[package])


def test_ti_core_layers_import_only_the_layers_below_them() -> None:
    graph = _graph("ti_core")
    assert len(graph) > 20  # the walk found the package
    bad = sorted(
        f"{name} imports {target}"
        for name, targets in graph.items()
        for layer, forbidden in FORBIDDEN.items()
        if name == layer or name.startswith(layer + ".")
        for target in targets
        if any(target == f or target.startswith(f + ".") for f in forbidden)
    )
    assert bad == []


def test_ti_core_stands_at_most_six_floors_deep() -> None:
    """api -> observer -> gate -> capture | emission | sentinel -> reduction | compiled -> the
    foundations (errors, entries, _torch, ...): a reader climbs at most six floors to learn
    where a number is made, and capture, emission and the flight recorder stand side by side."""
    parts, _ = _part_graph(_graph("ti_core"), "ti_core")
    chains = _chains(parts)
    tallest = max(chains.values(), key=len)
    assert len(tallest) <= MAX_FLOORS, " -> ".join(tallest)
    floor = {part: len(chain) for part, chain in chains.items()}
    assert floor["ti_core.api"] == 6
    assert floor["ti_core.observer"] == 5
    assert floor["ti_core.gate"] == 4
    assert floor["ti_core.capture"] == floor["ti_core.emission"] == floor["ti_core.sentinel"] == 3
    assert floor["ti_core.reduction"] == floor["ti_core.compiled"] == 2


def test_the_floor_counter_counts_the_longest_chain() -> None:
    chains = _chains({"a": {"b", "c"}, "b": {"d"}, "c": set(), "d": set(), "e": {"a"}})
    assert chains["e"] == ["e", "a", "b", "d"]
    assert chains["c"] == ["c"]


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / "ti-examples" / "src" / "ti_examples"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from ti_examples.a import x\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n"
    )
    (pkg / "b.py").write_text("def f():\n    import ti_examples.sub.c.name\n")
    (pkg / "sub" / "__init__.py").write_text("from .c import y\nfrom .. import a\n")
    (pkg / "sub" / "c.py").write_text("import torch\nfrom ti_examples import b\n")
    assert _graph("ti_examples", tmp_path) == {
        "ti_examples": {"ti_examples.a"},
        "ti_examples.a": {"ti_examples.b"},
        "ti_examples.b": {"ti_examples.sub.c"},
        "ti_examples.sub": {"ti_examples.sub.c", "ti_examples.a"},
        "ti_examples.sub.c": {"ti_examples.b"},
    }
    assert _packages("ti_examples", tmp_path) == {"ti_examples", "ti_examples.sub"}


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_a_cycle_between_subpackages_is_found_without_one_between_modules() -> None:
    """``p.capture.hooks -> p.compiled.traced`` and ``p.compiled.record -> p.capture.batch``:
    no two modules import each other, yet each subpackage imports the other."""
    graph = {
        "p": {"p.capture", "p.gate"},
        "p.gate": {"p.capture.hooks"},
        "p.capture": {"p.capture.hooks"},
        "p.capture.hooks": {"p.compiled.traced"},
        "p.capture.batch": set(),
        "p.compiled": set(),
        "p.compiled.traced": set(),
        "p.compiled.record": {"p.capture.batch"},
    }
    assert _cycles(graph) == []
    assert _part_cycles(graph, ["p", "p.capture", "p.compiled"]) == [
        "p: p.capture <-> p.compiled (p.capture.hooks -> p.compiled.traced; "
        "p.compiled.record -> p.capture.batch)"
    ]
    graph["p.compiled.record"] = set()
    assert _part_cycles(graph, ["p", "p.capture", "p.compiled"]) == []
