"""ti-core's structure: one row layout for every engine (docs/metrics.md), and the reduction
engine's tables agree with ti-schema. That imports point one way, between its modules and
between its layers, is checked with every package's in tests/test_import_graph.py."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

from ti_core.reduction import (
    ReductionPlan,
    default_reducers,
    layout,
    numpy_rows,
    support,
    torch_rows,
)
from ti_schema import DEFAULT_METRICS, FINITE_METRICS


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
