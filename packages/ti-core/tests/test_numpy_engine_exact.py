"""The numpy engine (``numpy_rows``, ``numpy_histograms``) held to numpy float64 bit for bit.

Large arrays are reduced in one pass with sample-placed quartile bands; a band that misses its
ranks falls back to an exact ``numpy.partition`` of a copy of the array. The values alone
cannot tell the two apart, so these tests also check the bands' own counts against numpy and
that ordinary data (ties, ReLU zeros, non-finite entries) never needs the copy: tracemalloc
sees numpy's allocations. Histograms are compared with ``numpy.histogram`` over
``numpy.linspace`` edges, edges and counts exactly.
"""

from __future__ import annotations

import math
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest
import torch
from _core_helpers import assert_row

from ti_core.reduction import (
    DefaultProfile,
    ReductionPlan,
    histograms,
    layout,
    numpy_histograms,
    numpy_rows,
    support,
)
from ti_core.reduction.numpy_rows import BLOCK, PARALLEL_MIN, Moments
from ti_core.reduction.quantiles import quantile_positions


def dataset(kind: str, n: int, seed: int = 0) -> np.ndarray:
    gen = np.random.default_rng(seed)
    if kind == "normal":
        return gen.normal(1.0, 3.0, size=n).astype(np.float32)
    if kind == "relu":  # 60% zeros, -0.0 among them: the lower quartile is a tie
        a = np.maximum(gen.normal(-0.25, 1.0, size=n), 0.0).astype(np.float32)
        a[gen.random(n) < 0.05] = -0.0
        return a
    if kind == "discrete":  # four values, every quartile well inside a tie: one-value bands
        return gen.choice(np.float32([0, 1, 2, 3]), size=n, p=[0.1, 0.3, 0.5, 0.1])
    if kind == "few":  # ties at the band ends and values between them
        a = gen.integers(0, 40, size=n).astype(np.float64) / 8.0
        a[gen.random(n) < 0.5] += gen.normal(size=n)[gen.random(n) < 0.5][:1]
        return a
    if kind == "nonfinite":  # whole blocks without finite entries, one with a single one
        a = gen.normal(size=n).astype(np.float32)
        a[BLOCK : 2 * BLOCK] = np.nan
        a[2 * BLOCK : 3 * BLOCK] = np.inf
        a[2 * BLOCK + 7] = 0.5
        a[gen.integers(0, n, 1000)] = -np.inf
        return a
    raise AssertionError(kind)


KINDS = ("normal", "relu", "discrete", "few", "nonfinite")


def finite_sorted(a: np.ndarray) -> np.ndarray:
    f = a[np.isfinite(a)].astype(np.float64)
    f.sort()
    return f


# -- the bands ------------------------------------------------------------------------------------


def scanned(a: np.ndarray, halves: bool) -> list[numpy_rows._Band]:
    """The quartile bands of ``a`` after a pass over its finite entries, block by block; with
    ``halves`` the pass is two scans merged, as the parallel reduction does."""
    bands = numpy_rows._bands(a)
    assert bands is not None
    template = numpy_rows._BandScan(bands)
    mid = (a.size // BLOCK // 2) * BLOCK if halves else a.size
    scans = [template.fresh(), template.fresh()] if halves else [template]
    for scan, (start, stop) in zip(scans, [(0, mid), (mid, a.size)], strict=False):
        for first in range(start, stop, BLOCK):
            c = a[first : min(first + BLOCK, stop)]
            scan.scan(c[np.isfinite(c)])
    if halves:
        for scan in scans:
            template.merge(scan)
    return template.finish()


@pytest.mark.parametrize("halves", [False, True], ids=["one", "merged"])
@pytest.mark.parametrize("kind", KINDS)
def test_band_counts_equal_numpy(kind: str, halves: bool) -> None:
    a = dataset(kind, 5 * BLOCK + 1234)
    f = finite_sorted(a)
    for band, (lo_rank, hi_rank, _) in zip(
        scanned(a, halves), quantile_positions(f.size), strict=True
    ):
        assert band.below == np.count_nonzero(f < band.lo)
        inside = np.sort(band.inside.astype(np.float64))
        if band.lo == band.hi:
            assert band.at_lo == np.count_nonzero(f == band.lo)
            assert inside.size == 0
        elif band.tied:
            assert band.at_lo == np.count_nonzero(f == band.lo)
            assert band.at_hi == np.count_nonzero(f == band.hi)
            np.testing.assert_array_equal(inside, f[(f > band.lo) & (f < band.hi)])
        else:
            assert band.at_lo == band.at_hi == 0
            np.testing.assert_array_equal(inside, f[(f >= band.lo) & (f <= band.hi)])
        ranks = [lo_rank] if hi_rank == lo_rank else [lo_rank, hi_rank]
        assert band.values(ranks) == [f[r] for r in ranks]


def test_ties_are_flagged_and_one_valued_bands_collect_nothing() -> None:
    discrete = numpy_rows._bands(dataset("discrete", 300_000))
    normal = numpy_rows._bands(dataset("normal", 300_000))
    assert discrete is not None
    assert normal is not None
    assert all(b.lo == b.hi for b in discrete)  # the quartiles of 0..3 are single values
    assert all(b.tied for b in discrete)
    assert all(math.isfinite(b.lo) and math.isfinite(b.hi) and b.lo < b.hi for b in normal)
    relu = numpy_rows._bands(dataset("relu", 300_000))
    assert relu is not None
    assert relu[0].tied
    assert relu[0].lo == relu[0].hi == 0.0


def test_band_values_walk_ties_inside_and_above() -> None:
    band = numpy_rows._Band(1.0, 3.0, tied=True)
    band.below, band.at_lo, band.at_hi = 10, 2, 4
    band.inside = np.array([2.5, 1.5, 2.0])
    # ranks 10..11 are the ties at 1.0, 12..14 inside, 15..18 the ties at 3.0
    assert band.values([10, 11]) == [1.0, 1.0]
    assert band.values([11, 12]) == [1.0, 1.5]
    assert band.values([12, 13]) == [1.5, 2.0]
    assert band.values([14, 15]) == [2.5, 3.0]
    assert band.values([18]) == [3.0]
    assert band.values([9, 10]) is None  # below the band
    assert band.values([18, 19]) is None  # past it
    assert band.values([0]) is None


@pytest.mark.parametrize("k", range(9))
def test_band_values_of_every_rank_inside(k: int) -> None:
    inside = np.random.default_rng(k).permutation(10) + 0.5
    for ranks in ([k], [k, k + 1]):
        band = numpy_rows._Band(0.0, 10.0, tied=False)
        band.inside = inside.copy()
        assert band.values(ranks) == [r + 0.5 for r in ranks]


def test_band_select_keeps_what_count_collected() -> None:
    found = np.array([0.0, 1.0, 1.5, 2.0, 3.0])
    assert numpy_rows._Band(1.0, 2.0, tied=False).select(found).tolist() == [1.0, 1.5, 2.0]
    assert numpy_rows._Band(1.0, 2.0, tied=True).select(found).tolist() == [1.5]
    assert numpy_rows._Band(1.0, 1.0, tied=True).select(found).tolist() == []
    c = np.array([0.0, 1.0, 1.0, 1.5, 2.0, 3.0])
    band = numpy_rows._Band(1.0, 2.0, tied=True)
    assert band.count(c).tolist() == [False, False, False, True, False, False]
    assert (band.below, band.at_lo, band.at_hi) == (1, 2, 1)
    open_band = numpy_rows._Band(1.0, 2.0, tied=False)
    assert open_band.count(c).tolist() == [False, True, True, True, True, False]
    assert (open_band.below, open_band.at_lo, open_band.at_hi) == (1, 0, 0)


# -- reduce_large ---------------------------------------------------------------------------------


def peak_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def check_moments(m: Moments, a: np.ndarray) -> None:
    f = finite_sorted(a)
    assert (m.lo, m.hi, m.finite, m.nonfinite) == (f[0], f[-1], f.size, a.size - f.size)
    assert m.total == pytest.approx(math.fsum(f), rel=1e-12, abs=1e-9)
    assert m.squares == pytest.approx(math.fsum(f * f), rel=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_reduce_large_is_exact_and_copies_nothing(kind: str) -> None:
    a = dataset(kind, 2_000_003, seed=1)
    out: list[tuple[np.ndarray, Moments]] = []
    peak = peak_bytes(lambda: out.append(numpy_rows.reduce_large(a)))
    row, moments = out[0]
    assert_row(row, a)
    check_moments(moments, a)
    # the exact fallback would copy the array; a pass needs its block buffers only
    assert peak < a.nbytes // 2, (peak, a.nbytes)


@pytest.mark.parametrize("kind", ["relu", "nonfinite"])
def test_reduce_large_in_halves_is_bit_identical(kind: str) -> None:
    a = dataset(kind, PARALLEL_MIN + 3 * BLOCK + 17, seed=2)
    one, m_one = numpy_rows.reduce_large(a, parallel=False)
    out: list[tuple[np.ndarray, Moments]] = []
    peak = peak_bytes(lambda: out.append(numpy_rows.reduce_large(a, parallel=True)))
    two, m_two = out[0]
    np.testing.assert_array_equal(one, two)
    assert m_one == m_two
    assert_row(two, a)
    assert peak < a.nbytes // 2, (peak, a.nbytes)


def test_reduce_large_without_finite_entries() -> None:
    a = np.full(3 * BLOCK, np.nan, dtype=np.float32)
    a[::5] = -np.inf
    row, m = numpy_rows.reduce_large(a)
    assert_row(row, a)
    assert m == Moments(math.inf, -math.inf, 0, a.size, 0.0, 0.0)


def test_reduce_large_recenters_when_the_sample_is_far_from_the_mean() -> None:
    # 40 finite entries among NaN: the sample holds a handful, so the middle band is open and
    # the first pass sums around 0; values near 1e8 with unit spread need the second pass
    gen = np.random.default_rng(3)
    a = np.full(400_000, np.nan)
    a[gen.choice(a.size, 40, replace=False)] = 1e8 + gen.normal(size=40)
    row, m = numpy_rows.reduce_large(a)
    assert_row(row, a)
    check_moments(m, a)


def test_reduce_large_recenters_a_narrow_spread_far_from_the_sample() -> None:
    # the same, with a spread of 1e-3 around 1e3: a one-pass variance would lose it
    gen = np.random.default_rng(4)
    a = np.full(400_000, np.nan)
    a[gen.choice(a.size, 40, replace=False)] = 1e3 + 1e-3 * gen.normal(size=40)
    row, m = numpy_rows.reduce_large(a)
    assert_row(row, a)
    check_moments(m, a)


def test_quartiles_without_bands_partition_the_finite_entries() -> None:
    a = dataset("nonfinite", 3 * BLOCK + 5)
    nf = int(np.count_nonzero(np.isfinite(a)))
    f = finite_sorted(a)
    got = numpy_rows._quartiles(a, nf, None)
    assert got == [float(x) for x in np.percentile(f, [25, 50, 75])]
    b = dataset("normal", 3 * BLOCK)
    before = b.copy()
    assert numpy_rows._quartiles(b, b.size, None) == [
        float(x) for x in np.percentile(b.astype(np.float64), [25, 50, 75])
    ]
    np.testing.assert_array_equal(b, before)  # the caller's array is not reordered


# -- histograms -----------------------------------------------------------------------------------


def check_histogram(row: np.ndarray, a: np.ndarray, bins: int) -> None:
    """A histogram row against numpy.histogram over numpy.linspace edges, bit for bit."""
    f = finite_sorted(a)
    head = row[: layout.HISTOGRAM_HEAD]
    assert head[layout.H_NUM] == f.size
    assert head[layout.H_NONFINITE] == a.size - f.size
    if f.size == 0:  # an empty histogram: its edges are never read
        assert not row[layout.histogram_counts(bins)].any()
        return
    assert (head[layout.H_MIN], head[layout.H_MAX]) == (f[0], f[-1])
    assert head[layout.H_SUM] == pytest.approx(math.fsum(f), rel=1e-12, abs=1e-300)
    assert head[layout.H_SUM_SQUARES] == pytest.approx(math.fsum(f * f), rel=1e-12, abs=1e-300)
    counts = row[layout.histogram_counts(bins)]
    if f[0] == f[-1]:
        assert counts.tolist() == [0.0] * (bins - 1) + [float(f.size)]
        return
    edges = np.linspace(f[0], f[-1], bins + 1)
    np.testing.assert_array_equal(row[layout.histogram_edges(bins)], edges)
    np.testing.assert_array_equal(counts, np.histogram(f, bins=edges)[0])


@pytest.mark.parametrize("kind", KINDS)
def test_histogram_large_with_and_without_known_moments(kind: str) -> None:
    a = dataset(kind, 4 * BLOCK + 99, seed=4)
    _, m = numpy_rows.reduce_large(a)
    for known, trusted in ((None, False), (m, False), (m, True)):
        check_histogram(numpy_histograms.histogram_large(a, 30, known, trusted=trusted), a, 30)


def test_histogram_of_large_float64_values_in_a_narrow_range() -> None:
    # float32 arithmetic cannot place 1e8 + [0, 1) into ten buckets: float64 data is
    # bucketed in float64
    a = 1e8 + np.random.default_rng(5).random(3 * BLOCK)
    check_histogram(numpy_histograms.histogram_large(a, 10), a, 10)


def wrong(m: Moments, **changes: float) -> Moments:
    fields = {f: getattr(m, f) for f in ("lo", "hi", "finite", "nonfinite", "total", "squares")}
    return Moments(**{**fields, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"hi": 0.0},  # narrower than the data
        {"lo": 0.5},
        {"finite": 17},  # right range, wrong count
        {"nonfinite": 0},  # says "all finite" of an array holding NaN
        {"lo": "next"},  # the minimum one float too high: only the range check sees it
    ],
    ids=["hi", "lo", "count", "nonfinite", "lo-next"],
)
def test_histogram_recounts_when_known_moments_do_not_fit(change: dict[str, float]) -> None:
    a = dataset("normal", 2 * BLOCK + 3, seed=6)
    a[[5, BLOCK + 9]] = np.nan
    _, m = numpy_rows.reduce_large(a)
    if change.get("lo") == "next":
        change = {"lo": float(np.nextafter(m.lo, math.inf))}
    row = numpy_histograms.histogram_large(a, 30, wrong(m, **change))
    check_histogram(row, a, 30)


def test_histogram_of_a_block_holding_one_finite_entry() -> None:
    a = np.full(3 * BLOCK, np.nan, dtype=np.float32)
    a[BLOCK // 2] = -1.0  # the only finite entry of block 0
    a[2 * BLOCK :] = np.linspace(0.0, 1.0, BLOCK, dtype=np.float32)  # block 1 has none
    check_histogram(numpy_histograms.histogram_large(a, 16), a, 16)
    assert numpy_histograms.scan_moments(a).finite == BLOCK + 1


def test_histogram_of_one_finite_entry_and_of_an_extreme_range() -> None:
    one = np.full(BLOCK + 10, np.nan)
    one[BLOCK + 3] = 4.0
    check_histogram(numpy_histograms.histogram_large(one, 30), one, 30)
    # a range whose width times the bins overflows float64, while bins / width does not
    wide = np.linspace(-8e307, 8e307, 3 * BLOCK)
    with np.errstate(over="ignore", invalid="ignore"):  # the sums overflow; the buckets do not
        row = numpy_histograms.histogram_large(wide, 30)
    edges = np.linspace(wide[0], wide[-1], 31)
    np.testing.assert_array_equal(row[layout.histogram_edges(30)], edges)
    np.testing.assert_array_equal(
        row[layout.histogram_counts(30)], np.histogram(wide, bins=edges)[0]
    )


def test_scan_moments_skips_blocks_without_finite_entries() -> None:
    a = dataset("nonfinite", 4 * BLOCK + 10, seed=7)
    check_moments(numpy_histograms.scan_moments(a), a)


def sorted_rows(arrays: list[np.ndarray]) -> list[tuple[np.ndarray, Moments]]:
    out = []
    for a in arrays:
        f = np.sort(a[np.isfinite(a)])
        f64 = f.astype(np.float64)
        lo, hi = (float(f64[0]), float(f64[-1])) if f.size else (math.inf, -math.inf)
        out.append(
            (f, Moments(lo, hi, f.size, a.size - f.size, math.fsum(f64), math.fsum(f64 * f64)))
        )
    return out


def test_histograms_from_sorted_values() -> None:
    gen = np.random.default_rng(8)
    tiny = np.array([0.0, 5e-324, 1e-323, 1.5e-323, 0.0])  # a subnormal range: step 0
    arrays = [
        gen.normal(size=500).astype(np.float32),
        gen.normal(size=333),
        np.array([2.5, np.nan, 2.5], dtype=np.float32),  # constant
        np.array([np.nan, 7.0, np.inf]),  # one finite entry
        np.array([np.nan, np.inf], dtype=np.float32),  # none
        tiny,
        np.linspace(-1.0, 1.0, 101, dtype=np.float32),  # entries on the edges
    ]
    for bins in (1, 7, 30):
        out = numpy_histograms.histograms_sorted(sorted_rows(arrays), bins)
        assert out.shape == (len(arrays), layout.histogram_width(bins))
        for row, a in zip(out, arrays, strict=True):
            check_histogram(row, a, bins)
    assert numpy_histograms.histograms_sorted([], 5).shape == (0, layout.histogram_width(5))


# -- histogram rows of tensors --------------------------------------------------------------------


def test_histogram_rows_take_reorders_and_keeps_bins() -> None:
    tensors = [torch.arange(5.0), torch.ones(3), torch.tensor([-1.0, 1.0])]
    hist = histograms.histogram_rows(tensors, 4)
    picked = hist.take([2, 0])
    assert picked.bins == 4
    assert len(picked) == 2
    np.testing.assert_array_equal(picked.rows, hist.rows[[2, 0]])
    assert [h.num for h in picked.items()] == [2, 5]


def test_histogram_rows_reject_non_tensors_by_position() -> None:
    with pytest.raises(TypeError) as info:
        histograms.histogram_rows([torch.ones(2), [1.0]], 4)  # type: ignore[list-item]
    assert str(info.value) == "tensors[1] is a list; compute_histograms takes tensors"


def test_histograms_from_a_reduction_do_not_read_the_tensor_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.from_numpy(dataset("relu", 5_000))
    m = ReductionPlan([DefaultProfile()]).reduce([x])
    ordered = [m.ordered[0]]
    reads: list[int] = []
    real = support.flat_float
    monkeypatch.setattr(histograms, "flat_float", lambda t: reads.append(1) or real(t))
    (row,) = histograms.histogram_rows([x], 30, ordered).rows
    assert reads == []  # counted from the sorted values the reduction kept
    check_histogram(row, x.numpy(), 30)
    (h,) = histograms.compute_histograms([x], 30, ordered)
    assert reads == []
    assert h.num == x.numel()
    # lists shorter than the tensors: the rest are counted from the tensors themselves
    rows = histograms.histogram_rows([x, x * 2], 30, ordered, moments=[None]).rows
    assert reads == [1]
    check_histogram(rows[1], (x * 2).numpy(), 30)


def test_torch_histogram_edges_are_float64_linspace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(support, "uses_numpy", lambda device: False)
    a = dataset("normal", 10_001, seed=9)  # float32 values, float64 edges
    (row,) = histograms.histogram_rows([torch.from_numpy(a)], 30).rows
    check_histogram(row, a, 30)
