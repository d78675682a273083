"""Histograms counted from the reduction's sorted rows (``Measurements.ordered``), against
numpy float64: the path the observer takes for small CPU focus tensors."""

from __future__ import annotations

import math

import numpy as np
import torch
from test_histograms import DTYPES, check, sample

from ti_core.reduction import ReductionPlan, compute_histograms, default_reducers


def _tensors() -> list[torch.Tensor]:
    gen = np.random.default_rng(21)
    tensors = [sample(gen, dtype, 4096, 0.03).reshape(32, 128) for dtype in DTYPES]
    tensors += [sample(gen, dtype, 37, 0.1) for dtype in (torch.float32, torch.float64)]
    edge = torch.linspace(-3.0, 3.0, 31)  # entries exactly on the bucket edges
    tensors += [edge, torch.full((5, 7), 2.5), torch.full((64,), math.nan)]
    tensors += [torch.tensor([1.0, math.inf, -math.inf, 1.0, 3.0]), torch.zeros(3, 3)]
    return tensors


def test_ordered_rows_give_the_numpy_histogram() -> None:
    tensors = _tensors()
    got = ReductionPlan(default_reducers()).reduce(tensors)
    assert sorted(got.ordered) == list(range(len(tensors)))  # all small CPU tensors
    ordered = [got.ordered[i] for i in range(len(tensors))]
    for t, h in zip(tensors, compute_histograms(tensors, 30, ordered), strict=True):
        check(h, t, 30)
    for bins in (1, 7):
        for t, h in zip(tensors, compute_histograms(tensors, bins, ordered), strict=True):
            check(h, t, bins)


def test_ordered_path_matches_the_scanning_path() -> None:
    tensors = _tensors()
    got = ReductionPlan(default_reducers()).reduce(tensors)
    ordered = [got.ordered[i] for i in range(len(tensors))]
    fast = compute_histograms(tensors, 30, ordered)
    slow = compute_histograms([t.clone() for t in tensors], 30)
    for a, b in zip(fast, slow, strict=True):
        assert a.bucket_counts.tolist() == b.bucket_counts.tolist()
        np.testing.assert_array_equal(a.bucket_limits, b.bucket_limits)
        assert (a.min, a.max, a.num, a.nonfinite_count) == (b.min, b.max, b.num, b.nonfinite_count)


def test_zero_fraction_of_wide_rows_counts_signed_zeros() -> None:
    # rows from 8192 entries on count zeros by binary search in the sorted row
    gen = np.random.default_rng(5)
    vals = gen.standard_normal((3, 16384))
    vals[:, ::7] = 0.0
    vals[:, 3::11] = -0.0
    vals[1, ::13] = np.nan
    vals[2, 5::17] = -np.inf
    tensors = [torch.from_numpy(v.astype(np.float32)) for v in vals]
    tensors.append(torch.from_numpy(vals[0]))  # float64: a second batch
    got = ReductionPlan(default_reducers()).reduce(tensors)
    names = list(default_reducers()[0].names)
    col = names.index("zero_fraction")
    for i, t in enumerate(tensors):
        a = t.numpy().astype(np.float64)
        assert got.values[i, col] == np.count_nonzero(a == 0) / a.size
