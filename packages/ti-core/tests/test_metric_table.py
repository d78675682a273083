"""One description of each metric that follows from an engine's rows
(``ti_core.reduction.metric_table``), and the two engines kept equal by it: the numpy binding
and the torch binding give the same columns from the same rows, every engine table is the
shared one bound, and the two engines give the same values from the same tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ti_core.reduction import ReductionPlan, default_reducers, metric_table, numpy_rows, torch_rows
from ti_core.reduction.stability import NUMPY, TORCH, with_metrics
from ti_schema import DEFAULT_METRICS, DEFAULT_PROFILE, STABILITY_METRICS

CHOSEN = (*DEFAULT_METRICS, *STABILITY_METRICS)
OWN_PASS = {"kurtosis"}
"""Metrics that need a pass of their own over the entries, per engine."""


def _tensors() -> list[np.ndarray]:
    gen = np.random.default_rng(11)
    dirty = gen.normal(-2.0, 5.0, size=(6, 9))
    dirty[0, 0], dirty[2, 3], dirty[4, 4] = np.nan, np.inf, -np.inf
    return [
        gen.normal(0.0, 1.0, size=(4, 8)),
        dirty,
        np.zeros((3, 3)),
        np.full((2, 5), -7.25),
        np.array([[0.0, -0.0, 3.0, -1e-300, 1e150]]),
        gen.standard_t(3, size=(1, 40_000)),
    ]


def _numpy_rows(arrays: list[np.ndarray]) -> numpy_rows.Rows:
    """The rows the numpy engine learns, from numpy float64 directly."""
    width = max(a.size for a in arrays)
    entries = np.full((len(arrays), width), np.nan)
    numel, finite, zeros, mean, std, lo, hi, quartiles = ([] for _ in range(8))
    for r, a in enumerate(arrays):
        flat = a.ravel()
        entries[r, : flat.size] = flat
        f = flat[np.isfinite(flat)]
        numel.append(flat.size)
        finite.append(f.size)
        zeros.append(np.count_nonzero(flat == 0))
        mean.append(f.mean())
        std.append(f.std())
        lo.append(f.min())
        hi.append(f.max())
        quartiles.append(np.percentile(f, [25, 50, 75]))
    return numpy_rows.Rows(
        numel=np.array(numel, dtype=np.float64),
        finite=np.array(finite, dtype=np.float64),
        zeros=np.array(zeros, dtype=np.float64),
        mean=np.array(mean),
        std=np.array(std),
        lo=np.array(lo),
        hi=np.array(hi),
        quartiles=np.array(quartiles),
        entries=entries,
    )


def _torch_rows(rows: numpy_rows.Rows) -> torch_rows.Rows:
    """The same rows as the torch engine holds them."""
    fields = ("numel", "finite", "zeros", "mean", "std", "lo", "hi", "quartiles", "entries")
    return torch_rows.Rows(**{name: torch.from_numpy(getattr(rows, name)) for name in fields})


def test_every_metric_of_the_rows_is_declared_once() -> None:
    declared = {*DEFAULT_PROFILE.names, *STABILITY_METRICS}
    assert set(metric_table.ROW_METRICS) == declared - OWN_PASS
    assert set(numpy_rows.METRICS) == set(torch_rows.METRICS) == set(DEFAULT_PROFILE.names)
    assert set(NUMPY) == set(TORCH) == set(STABILITY_METRICS)


@pytest.mark.parametrize("name", sorted(metric_table.ROW_METRICS))
def test_the_two_bindings_give_the_same_column_from_the_same_rows(name: str) -> None:
    rows = _numpy_rows(_tensors())
    engine_numpy = {**numpy_rows.METRICS, **NUMPY}[name](rows)
    engine_torch = {**torch_rows.METRICS, **TORCH}[name](_torch_rows(rows))
    shared = metric_table.ROW_METRICS[name](rows, metric_table.NUMPY_OPS)
    assert isinstance(engine_numpy, np.ndarray)
    assert isinstance(engine_torch, torch.Tensor)
    assert engine_numpy.dtype == np.float64
    # bit for bit: the same float64 arithmetic, correctly rounded sqrt in both libraries
    np.testing.assert_array_equal(engine_numpy, engine_torch.numpy())
    np.testing.assert_array_equal(engine_numpy, shared)


def test_the_two_engines_give_the_same_values_from_the_same_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ti_core.reduction import support

    batch = [torch.from_numpy(a) for a in _tensors()]
    batch.append(torch.from_numpy(_tensors()[0]).to(torch.float32))
    plan = ReductionPlan(with_metrics(default_reducers(), CHOSEN))
    by_numpy = plan.reduce(batch)
    monkeypatch.setattr(support, "uses_numpy", lambda device: False)
    by_torch = ReductionPlan(with_metrics(default_reducers(), CHOSEN)).reduce(batch)
    assert not by_numpy.errors
    assert not by_torch.errors
    np.testing.assert_array_equal(by_numpy.available, by_torch.available)
    for j, name in enumerate(CHOSEN):
        ours, theirs = by_numpy.values[:, j], by_torch.values[:, j]
        ok = by_numpy.available[:, j]
        if name in ("mean", "std", "rms", "kurtosis"):  # float64 sums, in another order
            np.testing.assert_allclose(ours[ok], theirs[ok], rtol=1e-12, err_msg=name)
        else:  # order statistics and counts: bit for bit
            np.testing.assert_array_equal(ours[ok], theirs[ok], err_msg=name)
