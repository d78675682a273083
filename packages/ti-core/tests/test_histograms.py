"""Histograms of focus-layer tensors, against numpy float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _core_helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ti_core import AlwaysSampler, MemorySink, inject_observer, remove_observer
from ti_core.reduction import (
    HistogramData,
    ReductionPlan,
    compute_histograms,
    default_reducers,
    numpy_rows,
    support,
)
from ti_core.reduction.histograms import single_value_limit

DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
)


def check(h: HistogramData, t: torch.Tensor, bins: int) -> None:
    """``h`` against numpy: moments, counts, and np.histogram over the same edges."""
    a = t.detach().cpu().to(torch.float64).numpy().ravel()
    finite = a[np.isfinite(a)]
    assert h.num == finite.size
    assert h.nonfinite_count == a.size - finite.size
    assert h.bucket_counts.dtype == np.int64
    assert h.bucket_limits.dtype == np.float64
    if finite.size == 0:
        assert h.min is None
        assert h.max is None
        assert h.bucket_limits.size == 0
        assert h.bucket_counts.size == 0
        assert h.sum == 0.0
        assert h.sum_squares == 0.0
        return
    assert h.min is not None
    assert h.max is not None
    assert h.min == finite.min()
    assert h.max == finite.max()
    scale = float(np.abs(finite).max())
    assert h.sum == pytest.approx(finite.sum(), rel=1e-9, abs=1e-12 * scale * finite.size)
    assert h.sum_squares == pytest.approx(np.sum(finite * finite), rel=1e-9)
    assert int(h.bucket_counts.sum()) == h.num
    assert np.all(np.diff(h.bucket_limits) > 0)
    if h.min == h.max:
        assert h.bucket_counts.tolist() == [h.num]
        assert h.bucket_limits.tolist() == [single_value_limit(h.max)]
        return
    assert h.bucket_limits.size == bins
    assert h.bucket_limits[-1] == h.max
    assert h.bucket_limits[0] > h.min
    edges = np.concatenate([[h.min], h.bucket_limits])
    linspace = np.linspace(h.min, h.max, bins + 1)
    np.testing.assert_allclose(edges, linspace, rtol=1e-12)
    expected, _ = np.histogram(finite, bins=edges)
    np.testing.assert_array_equal(h.bucket_counts, expected)


def sample(
    gen: np.random.Generator, dtype: torch.dtype, size: int, nonfinite: float
) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.from_numpy(gen.random(size) < 0.4)
    if not dtype.is_floating_point:
        return torch.from_numpy(gen.integers(-100, 100, size)).to(dtype)
    vals = gen.standard_t(3, size) * 2.0
    specials = gen.random(size) < nonfinite
    vals[specials] = gen.choice([np.nan, np.inf, -np.inf], size=int(specials.sum()))
    return torch.from_numpy(vals).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_histograms_match_numpy(dtype: torch.dtype) -> None:
    gen = np.random.default_rng(1)
    tensors = [sample(gen, dtype, size, 0.05) for size in (1, 2, 17, 1000, 70_000)]
    tensors.append(sample(gen, dtype, 600, 0.0).reshape(20, 30).t())  # non-contiguous
    for t, h in zip(tensors, compute_histograms(tensors, bins=30), strict=True):
        check(h, t, 30)


def test_edges_hit_values_exactly() -> None:
    # 0..10 with 10 buckets: every interior value sits on an edge; the max closes the last.
    t = torch.arange(11, dtype=torch.float32)
    (h,) = compute_histograms([t], bins=10)
    np.testing.assert_array_equal(h.bucket_limits, np.arange(1, 11, dtype=np.float64))
    assert h.bucket_counts.tolist() == [1] * 9 + [2]
    check(h, t, 10)


def test_empty_nonfinite_constant_and_unsupported_tensors() -> None:
    tensors = [
        torch.zeros(0),
        torch.tensor([math.nan, math.inf, -math.inf]),
        torch.full((7,), -2.0),
        torch.tensor([5.0, math.nan, 5.0]),
        torch.ones(3, dtype=torch.complex64),
        torch.tensor(1e300, dtype=torch.float64),
    ]
    hs = compute_histograms(tensors, bins=4)
    check(hs[0], tensors[0], 4)
    check(hs[1], tensors[1], 4)
    assert hs[1].nonfinite_count == 3
    assert hs[2].bucket_counts.tolist() == [7]
    assert hs[2].bucket_limits.tolist() == [-1.5]
    assert hs[3].num == 2
    assert hs[3].nonfinite_count == 1
    assert hs[3].bucket_counts.tolist() == [2]
    assert hs[4].num == 0
    assert hs[4].bucket_counts.size == 0
    assert hs[5].bucket_limits[0] > 1e300


def test_half_precision_moments_do_not_overflow() -> None:
    t = torch.full((4096,), 65504.0, dtype=torch.float16)
    (h,) = compute_histograms([t])
    assert h.sum_squares == pytest.approx(4096 * 65504.0**2)
    assert math.isfinite(h.sum_squares)


def test_large_tensor_histogram() -> None:
    gen = torch.Generator().manual_seed(3)
    t = torch.randn(3_000_001, generator=gen)
    t[::97] = math.nan
    (h,) = compute_histograms([t], bins=64)
    check(h, t, 64)


@pytest.mark.parametrize("bins", [30, 7])
def test_large_tensor_entries_on_and_next_to_edges(bins: int) -> None:
    gen = np.random.default_rng(8)
    edges = np.linspace(0.0, 300_000.0, bins + 1)
    near = []
    for e in edges:
        f = np.float32(e)
        near += [f, np.nextafter(f, np.float32(-np.inf)), np.nextafter(f, np.float32(np.inf))]
    near_arr = np.clip(np.array(near, dtype=np.float32), 0.0, 300_000.0)
    body = gen.uniform(0.0, 300_000.0, 200_000).astype(np.float32)
    t = torch.from_numpy(np.concatenate([body, np.repeat(near_arr, 50)]))
    (h,) = compute_histograms([t], bins=bins)
    check(h, t, bins)
    (h64,) = compute_histograms([t.double()], bins=bins)
    check(h64, t.double(), bins)


def test_large_ties_constant_and_extreme_range() -> None:
    gen = torch.Generator().manual_seed(5)
    relu = torch.relu(torch.randn(300_000, generator=gen))
    constant = torch.full((100_000,), 7.0)
    wide = torch.tensor([-3e38, 3e38] * 50_000, dtype=torch.float32)
    for t in (relu, constant, wide):
        (h,) = compute_histograms([t], bins=30)
        check(h, t, 30)


def test_accelerator_code_path_matches_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(support, "uses_numpy", lambda device: False)
    gen = np.random.default_rng(4)
    tensors = [sample(gen, dtype, 100_000, 0.05) for dtype in (torch.float32, torch.int64)]
    tensors.append(torch.arange(300_001, dtype=torch.float32))
    for t, h in zip(tensors, compute_histograms(tensors, bins=30), strict=True):
        check(h, t, 30)


def test_histogram_after_reduction_reuses_its_moments_only_while_they_fit() -> None:
    gen = torch.Generator().manual_seed(6)
    t = torch.randn(300_000, generator=gen)
    t[::1000] = math.nan
    got = ReductionPlan(default_reducers()).reduce([t])
    assert sorted(got.moments) == [0]  # a large CPU tensor: its one pass left the moments
    known = [got.moments[0]]
    (h,) = compute_histograms([t], bins=30, moments=known)
    check(h, t, 30)
    t.mul_(3.0)  # the moments no longer describe the values: detected, recomputed
    (h,) = compute_histograms([t], bins=30, moments=known)
    check(h, t, 30)
    known = [ReductionPlan(default_reducers()).reduce([t]).moments[0]]
    t.numpy()[5] = 100.0  # a write outside [min, max] after the reduction
    (h,) = compute_histograms([t], bins=30, moments=known)
    check(h, t, 30)


def test_histograms_after_batched_reduction_of_medium_tensors() -> None:
    gen = np.random.default_rng(10)
    tensors = [sample(gen, dtype, 8192, 0.02).reshape(64, 128) for dtype in DTYPES]
    tensors += [torch.full((64, 64), 2.5), torch.full((64, 64), math.nan)]
    got = ReductionPlan(default_reducers()).reduce(tensors)
    assert sorted(got.ordered) == list(range(len(tensors)))  # batched: sorted rows and moments
    ordered = [got.ordered[i] for i in range(len(tensors))]
    row_moments = [m for _, m in ordered]  # the moments implied by each tensor's profile row
    for known in ({"ordered": ordered}, {"moments": row_moments}, {}):
        for t, h in zip(tensors, compute_histograms(tensors, 30, **known), strict=True):
            check(h, t, 30)


def test_moments_from_a_reduction_with_far_pivots_stay_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def far_bands(a: np.ndarray) -> list[numpy_rows._Band]:
        return [numpy_rows._Band(1e6, 2e6, tied=False) for _ in range(3)]

    monkeypatch.setattr(numpy_rows, "_bands", far_bands)
    t = torch.randn(200_000, generator=torch.Generator().manual_seed(2))
    got = ReductionPlan(default_reducers()).reduce([t])
    (h,) = compute_histograms([t], bins=30, moments=[got.moments[0]])
    check(h, t, 30)


def test_bad_bins_are_rejected() -> None:
    for bad in (0, -3, 2.5, True, "30"):
        with pytest.raises(ValueError, match="bins"):
            compute_histograms([torch.ones(3)], bins=bad)  # type: ignore[arg-type]


def test_rng_state_untouched() -> None:
    tensors = [torch.randn(1000), torch.arange(300_000.0)]
    before = torch.get_rng_state()
    compute_histograms(tensors)
    assert torch.equal(before, torch.get_rng_state())


@settings(max_examples=examples(40), deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    bins=st.integers(1, 50),
    nonfinite=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_histograms_match_numpy(
    dtype: torch.dtype, sizes: list[int], bins: int, nonfinite: float, seed: int
) -> None:
    gen = np.random.default_rng(seed)
    tensors = [sample(gen, dtype, size, nonfinite) for size in sizes]
    for t, h in zip(tensors, compute_histograms(tensors, bins=bins), strict=True):
        check(h, t, bins)


def test_observed_histograms_are_the_same_under_inference_mode() -> None:
    """A large CPU focus tensor's histogram uses the moments its reduction carried, whatever
    the grad mode it was captured in (inference tensors have no version counter)."""
    x = torch.randn(300, 300, generator=torch.Generator().manual_seed(11)) * 3 + 1
    got = []
    for mode in (torch.no_grad, torch.inference_mode):
        model = nn.Sequential(nn.Identity())
        sink = MemorySink()
        inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
        with mode():
            model(x)
        remove_observer(model)
        got.append(sink.histograms().drop_columns(["run_id", "timestamp"]).to_pylist())
    assert got[0] == got[1]
    (row,) = got[0]
    (h,) = compute_histograms([x], bins=30)
    assert (row["sum"], row["sum_squares"]) == pytest.approx((h.sum, h.sum_squares), rel=1e-12)


@settings(max_examples=examples(20), deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    extra=st.integers(0, 3 * (1 << 16)),
    bins=st.integers(1, 64),
    nonfinite=st.sampled_from([0.0, 1e-4, 0.3, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_large_histograms_match_numpy(
    dtype: torch.dtype, extra: int, bins: int, nonfinite: float, seed: int
) -> None:
    """Above the 65,536-entry threshold (one-pass moments, chunked counting)."""
    gen = np.random.default_rng(seed)
    t = sample(gen, dtype, (1 << 16) + 1 + extra, nonfinite)
    (h,) = compute_histograms([t], bins=bins)
    check(h, t, bins)
