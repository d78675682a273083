"""ti-core's structure: imports between its modules point one way, one row layout for every
engine (docs/metrics.md), and the reduction engine's tables agree with ti-schema."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import ti_core
from ti_core.reduction import (
    ReductionPlan,
    default_reducers,
    layout,
    numpy_rows,
    support,
    torch_rows,
)
from ti_schema import DEFAULT_METRICS, FINITE_METRICS

SRC = Path(ti_core.__file__).parent


def _modules() -> dict[str, Path]:
    """Every module of ti_core by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ti_core modules ``name`` imports, wherever the import statement is (function
    bodies and ``if TYPE_CHECKING:`` blocks included). ``from pkg import x`` names the module
    ``pkg.x`` when there is one, else ``pkg``. The implicit import of a module's parent
    packages is not an edge: every submodule has it, and it is how packages work."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            if base != "ti_core" and not base.startswith("ti_core."):
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in modules else base)
    found.discard(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_ti_core_modules() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 20  # the walk found the package
    assert "ti_core.reduction.plan" in graph["ti_core.capture.batch"]  # it sees edges
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_layers_import_one_way() -> None:
    """reduction knows nothing of capture, emission or the observer; capture nothing of
    emission, the gate or the observer; emission nothing of the gate or the observer."""
    modules = _modules()
    below = {
        "ti_core.reduction": ("ti_core.capture", "ti_core.emission", "ti_core.gate"),
        "ti_core.capture": ("ti_core.emission", "ti_core.gate", "ti_core.observer"),
        "ti_core.emission": ("ti_core.gate", "ti_core.observer", "ti_core.capture.hooks"),
    }
    for name, path in modules.items():
        for layer, forbidden in below.items():
            if name == layer or name.startswith(layer + "."):
                imported = _imports(name, path, modules)
                bad = sorted(m for m in imported for f in forbidden if m.startswith(f))
                assert not bad, f"{name} imports {bad}"


def test_profile_row_columns_are_the_schema_metrics_then_the_finite_count() -> None:
    lay = layout.DEFAULT_LAYOUT
    assert (*DEFAULT_METRICS, "finite_count") == lay.columns
    assert len(lay.columns) == lay.width == len(DEFAULT_METRICS) + 1
    assert lay.finite_count == lay.width - 1
    assert [lay.columns[c] for c in sorted(lay.over_finite)] == list(FINITE_METRICS)
    assert {lay.index(name): name for name in lay.columns} == dict(enumerate(lay.columns))
    assert layout.histogram_width(30) == 6 + 31 + 30


def test_every_default_metric_has_one_function_per_engine() -> None:
    from ti_core.reduction import numpy_rows, torch_rows

    assert tuple(numpy_rows.METRICS) == DEFAULT_METRICS
    assert tuple(torch_rows.METRICS) == DEFAULT_METRICS


def _numpy_reference_row(t: torch.Tensor) -> list[float]:
    a = t.numpy().astype(np.float64).ravel()
    finite = a[np.isfinite(a)]
    return [
        finite.mean(),
        finite.std(),
        finite.min(),
        finite.max(),
        *np.percentile(finite, [25, 50, 75]),
        np.count_nonzero(a == 0) / a.size,
        (a.size - finite.size) / a.size,
        finite.size,
    ]


def test_both_engines_and_both_sizes_fill_the_columns_by_name() -> None:
    """Each engine's small and large rows, column by column, against numpy float64."""
    gen = torch.Generator().manual_seed(3)
    small = torch.randn(6, 7, generator=gen)
    large = torch.randn(70_000, generator=gen)
    for t in (small, large):
        t.view(-1)[::5] = 0.0
        t.view(-1)[1::9] = float("inf")
    rows = {
        "numpy small": numpy_rows.batched_rows(
            small.reshape(1, -1).numpy().copy(), np.array([42.0])
        )[0][0],
        "numpy large": numpy_rows.reduce_large(large.numpy())[0],
        "torch small": torch_rows.batched_rows([[small]], small.device)[0].numpy(),
        "torch large": torch_rows.large_row_exact(support.flat_float(large)).numpy(),
    }
    for label, row in rows.items():
        t = small if "small" in label else large
        np.testing.assert_allclose(row, _numpy_reference_row(t), rtol=1e-6, err_msg=label)


def test_large_cpu_moments_are_carried_in_the_measurements() -> None:
    t = torch.randn(100_000, generator=torch.Generator().manual_seed(8))
    small = torch.randn(5, 5)
    got = ReductionPlan(default_reducers()).reduce([small, t])
    assert sorted(got.ordered) == [0]
    assert sorted(got.moments) == [1]
    m = got.moments[1]
    a = t.numpy().astype(np.float64)
    assert (m.lo, m.hi, m.finite, m.nonfinite) == (a.min(), a.max(), a.size, 0)
    np.testing.assert_allclose([m.total, m.squares], [a.sum(), (a * a).sum()], rtol=1e-9)


def test_importing_ti_core_leaves_torch_dynamo_and_dtensor_unimported() -> None:
    """torch.compile's machinery costs seconds and ~80 MB to import, torch.distributed.tensor
    ~0.4 s and ~40 MB: a process that does not use them (inference, evaluation; constructing a
    torch 2.13 optimizer imports both anyway) does not pay for them because it is observed.
    The hooks wrap themselves for compile on first use under it; a DTensor parameter is
    recognized through the module its maker imported. Parameter signals included."""
    probe = (
        "import sys, torch, ti_core; from torch import nn; "
        "m = nn.Sequential(nn.Linear(2, 2)); s = ti_core.MemorySink(); "
        "ti_core.inject_observer(m, sink=s, output_dir=None, sampler=ti_core.AlwaysSampler(), "
        "signals=('output', 'output_gradient', 'parameter', 'parameter_gradient')); "
        "m(torch.randn(3, 2)).sum().backward(); ti_core.remove_observer(m); "
        "assert set(s.table()['signal'].to_pylist()) == {'output', 'output_gradient', "
        "'parameter', 'parameter_gradient'}; "
        "print('torch._dynamo' in sys.modules, 'torch.distributed.tensor' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False False"
