"""Profile rows with numpy, on host memory: small tensors batched, large ones in one pass.

The numpy engine of :class:`~ti_core.reduction.plan.ReductionPlan` (CPU tensors, see
:func:`~ti_core.reduction.support.uses_numpy`). Rows follow :mod:`~ti_core.reduction.layout`.
Both paths compute what the profile's metrics are made of (:class:`Rows`: counts, moments,
extremes, quartiles, and the entries themselves), and one function per metric
(:data:`METRICS`) turns that into the metric's column (:func:`fill`).

- :func:`batched_rows`: small tensors as the rows of one NaN-padded matrix, sorted in place
  (the sorted rows also serve the histograms of the same tensors).
- :func:`reduce_large`: a large tensor read from memory once, in blocks of :data:`BLOCK`
  entries that fit the CPU cache (SIMD comparisons, cheap compaction). Quartiles are exact:
  sample-placed candidate bands (:mod:`~ti_core.reduction.bands`) are collected during the pass
  and a band that misses its ranks is replaced by an exact ``numpy.partition``.

Both also return the :class:`Moments` that a histogram of the same values needs, so that
histogram costs no second pass; the caller carries them (``Measurements.moments`` and
``Measurements.ordered``).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, TypeVar

import numpy as np

from ti_core.reduction import metric_table
from ti_core.reduction.bands import SAMPLE_SEED, SAMPLE_SIZE, sample_span
from ti_core.reduction.layout import DEFAULT_LAYOUT, ProfileLayout
from ti_core.reduction.quantiles import QUANTILES, lerp, lerp_array, quantile_positions
from ti_schema import DEFAULT_PROFILE

BLOCK: Final = 1 << 17
"""Entries per block of a pass over a large array: a float32 block and its float64 copy stay in
a per-core cache."""

_SEARCH_ZEROS: Final = 1 << 13
"""From this row width on, zeros are counted by binary search in the sorted rows."""


@dataclass(frozen=True)
class Moments:
    """What a pass over an array learned that a histogram of the same values needs."""

    lo: float
    hi: float
    finite: int
    nonfinite: int
    total: float
    squares: float


def row_moments(row: np.ndarray, numel: int, layout: ProfileLayout = DEFAULT_LAYOUT) -> Moments:
    """The moments implied by the profile row of a tensor of ``numel`` entries."""
    nf = int(row[layout.finite_count])
    columns = layout.moment_columns
    if columns is None:
        raise ValueError(f"a profile row without mean, std, min and max: {layout.columns}")
    mean_col, std_col, min_col, max_col = columns
    mean, std = float(row[mean_col]), float(row[std_col])
    return Moments(
        float(row[min_col]),
        float(row[max_col]),
        nf,
        numel - nf,
        mean * nf,
        (std * std + mean * mean) * nf,
    )


@dataclass(frozen=True)
class Rows:
    """What the numpy engine learned about each of ``k`` tensors (one row each), in float64;
    a metric function (:data:`METRICS`) turns it into that metric's ``(k,)`` column. Over the
    finite entries, the values of a tensor without any are NaN (the plan marks them
    unavailable)."""

    numel: np.ndarray
    """Element counts."""
    finite: np.ndarray
    """Finite entries."""
    zeros: np.ndarray
    """Entries equal to zero (either sign)."""
    mean: np.ndarray
    std: np.ndarray
    """Population std."""
    lo: np.ndarray
    """Smallest finite entry."""
    hi: np.ndarray
    """Largest finite entry."""
    quartiles: np.ndarray
    """``(k, 3)``: the quantiles of ``quantiles.QUANTILES``, numpy's linear interpolation."""
    entries: np.ndarray
    """``(k, w)``: row ``r`` holds tensor ``r``'s entries (in no particular order) in its first
    ``numel[r]`` places and NaN after them (float32 or float64): for a metric that needs
    more than the above, at the price of its own pass."""
    last_dim: np.ndarray | None = None
    """``(k,)``: the size of each tensor's last dimension (its element count for a 0-d or 1-D
    tensor), where a metric reads entries in their order (``entries`` then holds them in
    row-major order); None: the engine path did not record it (every tensor 1-D)."""
    ordered: np.ndarray | None = None
    """``(k, w)``, where the path sorted anyway (the batched one): each row's finite entries
    ascending in its first ``finite`` places, ``+inf`` after them; None elsewhere."""
    cache: dict[object, object] = field(default_factory=dict, compare=False, repr=False)
    """What several metric functions of the same rows share (one pass for them all), keyed
    by the function family that computed it."""


NumpyMetric = Callable[[Rows], np.ndarray]
"""The numpy engine's function of one metric: :class:`Rows` of ``k`` tensors to ``(k,)``."""

METRICS: Final[Mapping[str, NumpyMetric]] = metric_table.bind(
    metric_table.NUMPY_OPS, DEFAULT_PROFILE.names
)
"""One function per metric of ``ti_schema.DEFAULT_PROFILE``: the shared table
(:data:`ti_core.reduction.metric_table.ROW_METRICS`) bound to this engine."""


def reads_order(layout: ProfileLayout, metrics: Mapping[str, NumpyMetric]) -> bool:
    """Whether a metric of ``layout`` reads ``Rows.entries`` in their order (its function has
    a true ``reads_order`` attribute): the batched path then sorts a copy."""
    return any(getattr(metrics[name], "reads_order", False) for name in layout.metrics)


def fill(rows: Rows, layout: ProfileLayout, metrics: Mapping[str, NumpyMetric]) -> np.ndarray:
    """The ``(k, layout.width)`` profile rows of ``rows``: each metric's function, in layout
    order, then the finite count. Call it under ``np.errstate(all="ignore")``: a tensor
    without finite entries gives NaN, which the plan marks unavailable."""
    out = np.empty((rows.numel.shape[0], layout.width))
    for column, name in enumerate(layout.metrics):
        out[:, column] = metrics[name](rows)
    out[:, layout.finite_count] = rows.finite
    return out


class _Scratch(threading.local):
    """Per-thread float64 work matrix of :func:`batched_rows`, kept between calls: a fresh
    megabyte-sized array per call costs more in page faults than the arithmetic on it."""

    buf: np.ndarray | None = None

    def take(self, shape: tuple[int, int]) -> np.ndarray:
        size = shape[0] * shape[1]
        if self.buf is None or self.buf.size < size:
            self.buf = np.empty(max(size, 1 << 16))
        return self.buf[:size].reshape(shape)


_scratch = _Scratch()

_QUANTILE_ARRAY = np.asarray(QUANTILES, dtype=np.float64)[None, :]


class _Band:
    """Candidate interval ``[lo, hi]`` for one quartile, and what the pass found there.

    When the sample shows ties at ``lo`` or ``hi`` (a ReLU output's zeros, say), entries equal
    to them are only counted, so a huge tie costs no copying; otherwise every entry in the
    closed band is collected.
    """

    def __init__(self, lo: float, hi: float, tied: bool) -> None:
        self.lo, self.hi, self.tied = lo, hi, tied
        self.below = 0
        self.at_lo = 0
        self.at_hi = 0
        self.inside = np.empty(0)
        """The collected entries, unordered (set by :class:`_BandScan` after the pass)."""

    def fresh(self) -> _Band:
        """The same band with nothing counted yet (for another part of the array)."""
        return _Band(self.lo, self.hi, self.tied)

    def count(self, c: np.ndarray) -> np.ndarray | None:
        """Count the block ``c`` below the band and at its tied ends; return the mask of the
        entries to collect (None: the band collects nothing)."""
        lo, hi = self.lo, self.hi
        ge = c >= lo
        n_ge = int(np.count_nonzero(ge))
        self.below += c.size - n_ge
        if lo == hi:
            self.at_lo += n_ge - int(np.count_nonzero(c > hi))
            return None
        if self.tied:
            gt = c > lo
            self.at_lo += n_ge - int(np.count_nonzero(gt))
            self.at_hi += int(np.count_nonzero(c == hi))
            return np.logical_and(gt, c < hi, out=gt)
        return np.logical_and(ge, c <= hi, out=ge)

    def select(self, found: np.ndarray) -> np.ndarray:
        """Of ``found`` (a superset), the entries this band collects."""
        if self.lo == self.hi:
            return found[:0]
        if self.tied:
            return found[(found > self.lo) & (found < self.hi)]
        return found[(found >= self.lo) & (found <= self.hi)]

    def values(self, ranks: list[int]) -> list[float] | None:
        """The values at ``ranks`` (ascending) of all finite entries, or None if the band
        misses one. Entries inside the band are selected, not sorted."""
        inside = self.inside
        out: list[float] = []
        part = -1  # ``inside`` is partitioned around this position
        for rank in ranks:
            r = rank - self.below
            if r < 0:
                return None
            if r < self.at_lo:
                out.append(self.lo)
                continue
            r -= self.at_lo
            if r < inside.size:
                if part < 0:
                    inside.partition(r)
                    part = r
                elif r == part + 1:  # the next order statistic: the smallest above
                    out.append(float(inside[r:].min()))
                    continue
                elif r != part:  # pragma: no cover - quartile ranks are equal or adjacent
                    inside.partition(r)
                    part = r
                out.append(float(inside[r]))
                continue
            r -= inside.size
            if r < self.at_hi:
                out.append(self.hi)
                continue
            return None
        return out


class _BandScan:
    """The three quartile bands scanned block by block with one compaction per block: the
    entries of every band are collected together and split by band after the pass."""

    def __init__(self, bands: list[_Band]) -> None:
        self.bands = bands
        self._found: list[np.ndarray] = []

    def scan(self, c: np.ndarray) -> None:
        union = None
        for band in self.bands:
            mask = band.count(c)
            if mask is not None:
                union = mask if union is None else np.logical_or(union, mask, out=union)
        if union is not None:
            idx = np.flatnonzero(union)
            if idx.size:
                self._found.append(c[idx])

    def fresh(self) -> _BandScan:
        """A scan of the same bands with nothing counted yet."""
        return _BandScan([band.fresh() for band in self.bands])

    def merge(self, other: _BandScan) -> None:
        """Add what ``other`` (a scan of the same bands over other blocks) found."""
        for band, theirs in zip(self.bands, other.bands, strict=True):
            band.below += theirs.below
            band.at_lo += theirs.at_lo
            band.at_hi += theirs.at_hi
        self._found += other._found

    def finish(self) -> list[_Band]:
        """Hand each band its collected entries."""
        found = np.concatenate(self._found) if self._found else np.empty(0)
        self._found = []
        for band in self.bands:
            band.inside = band.select(found)
        return self.bands


_T = TypeVar("_T")

PARALLEL_MIN: Final = 1 << 22
"""From this many entries on, a pass over an array reduced on the training thread (a tensor
too large to snapshot) is split with a helper thread: numpy releases the GIL in its loops, so
a second core halves the time the training step waits. The capture asks for the split only
where torch may use more than one intra-op thread (``torch.get_num_threads() > 1``): a run
limited to one thread gets no second one from its telemetry."""


def in_halves(n: int, run: Callable[[int, int], _T], parallel: bool) -> list[_T]:
    """``run(start, stop)`` over the blocks of ``[0, n)``: at once, or when ``parallel`` and
    ``n`` is large, as two halves (block-aligned), the first on a helper thread. The results
    come back in block order, so sequential sums of per-block values stay bit-identical."""
    blocks = -(-n // BLOCK)
    if not parallel or n < PARALLEL_MIN or blocks < 2 or (os.cpu_count() or 1) < 2:
        return [run(0, n)]
    mid = (blocks // 2) * BLOCK
    first: list[_T] = []
    failed: list[BaseException] = []

    def helper() -> None:
        try:
            first.append(run(0, mid))
        except BaseException as error:  # re-raised on the calling thread
            failed.append(error)

    # Lifecycle: one short-lived thread per pass (fork-safe, nothing left running).
    thread = threading.Thread(target=helper, name="ti-core reduction", daemon=True)
    thread.start()
    try:
        second = run(mid, n)
    finally:
        thread.join()
    if failed:
        raise failed[0]
    return [first[0], second]


def _bands(a: np.ndarray) -> list[_Band] | None:
    """Sample-chosen candidate bands for the three quartiles (None: no finite sample)."""
    gen = np.random.default_rng(SAMPLE_SEED)
    sample = a[gen.integers(0, a.size, SAMPLE_SIZE)]
    sample = np.sort(sample[np.isfinite(sample)])
    m = sample.size
    if m == 0:
        return None
    out = []
    for q in QUANTILES:
        i_lo, i_hi = sample_span(q, q, m)
        i_lo, i_hi = max(i_lo, 0), min(i_hi, m - 1)
        lo = float(sample[i_lo]) if i_lo > 0 else -math.inf
        hi = float(sample[i_hi]) if i_hi < m - 1 else math.inf
        ends = sample[[i_lo, i_hi]]
        repeats = np.searchsorted(sample, ends, "right") - np.searchsorted(sample, ends, "left")
        out.append(_Band(lo, hi, tied=bool((repeats > 1).any())))
    return out


@dataclass
class _Part:
    """What a pass over some blocks of an array found (see :func:`reduce_large`)."""

    zeros: int = 0
    nonfinite: int = 0
    lo: float = math.inf
    hi: float = -math.inf
    s1: list[float] = field(default_factory=list)
    """Per block with a finite entry, in block order: sum of ``x - shift``..."""
    s2: list[float] = field(default_factory=list)
    """... and of its square."""
    scan: _BandScan | None = None


def _scan_blocks(
    a: np.ndarray, start: int, stop: int, shift: float, scan: _BandScan | None
) -> _Part:
    part = _Part(scan=scan)
    buf = np.empty(min(BLOCK, stop - start), dtype=np.float64)
    for first in range(start, stop, BLOCK):
        c = a[first : min(first + BLOCK, stop)]
        part.zeros += int(np.count_nonzero(c == 0))
        cmin, cmax = float(c.min()), float(c.max())
        if not (math.isfinite(cmin) and math.isfinite(cmax)):
            size = c.size
            c = c[np.isfinite(c)]
            part.nonfinite += size - c.size
            if c.size == 0:
                continue
            cmin, cmax = float(c.min()), float(c.max())
        part.lo, part.hi = min(part.lo, cmin), max(part.hi, cmax)
        d = buf[: c.size]
        np.subtract(c, shift, out=d, dtype=np.float64)
        part.s1.append(float(d.sum()))
        part.s2.append(float(np.einsum("i,i->", d, d)))  # not BLAS: no thread pool
        if scan is not None:
            scan.scan(c)
    return part


def reduce_large(
    a: np.ndarray,
    parallel: bool = False,
    layout: ProfileLayout = DEFAULT_LAYOUT,
    metrics: Mapping[str, NumpyMetric] = METRICS,
    last_dim: int | None = None,
) -> tuple[np.ndarray, Moments]:
    """The exact profile row of a 1-D float32/float64 array, and the moments a histogram of
    the same array needs. ``parallel``: the caller waits for the result (the training thread),
    so the pass may use a helper thread (:func:`in_halves`). ``last_dim``: the last dimension
    of the tensor ``a`` flattens (row-major; default ``a.size``)."""
    n = a.size
    dims = np.array([float(n if last_dim is None else last_dim)])
    bands = _bands(a)
    # Shifting by a central value before summing keeps the one-pass variance exact in
    # float64: |mean - median| <= std, so E[(x - k)^2] is at most 2 var.
    shift = 0.0
    if bands is not None and math.isfinite(bands[1].lo) and math.isfinite(bands[1].hi):
        shift = 0.5 * (bands[1].lo + bands[1].hi)
    template = _BandScan(bands) if bands is not None else None
    parts = in_halves(
        n,
        lambda start, stop: _scan_blocks(
            a, start, stop, shift, template.fresh() if template is not None else None
        ),
        parallel,
    )
    lo_all, hi_all = math.inf, -math.inf
    zeros = nonfinite = 0
    s1 = s2 = 0.0
    for part in parts:  # in block order: the same float additions as one sequential pass
        zeros += part.zeros
        nonfinite += part.nonfinite
        lo_all, hi_all = min(lo_all, part.lo), max(hi_all, part.hi)
        for v in part.s1:
            s1 += v
        for v in part.s2:
            s2 += v
        if template is not None and part.scan is not None:
            template.merge(part.scan)
    if template is not None:
        bands = template.finish()
    nf = n - nonfinite

    def one(value: float) -> np.ndarray:
        return np.array([value], dtype=np.float64)

    nan = one(math.nan)
    if nf == 0:
        rows = Rows(
            one(n),
            one(0),
            one(zeros),
            nan,
            nan,
            nan,
            nan,
            np.full((1, 3), math.nan),
            a[None, :],
            dims,
        )
        with np.errstate(all="ignore"):
            row = fill(rows, layout, metrics)[0]
        return row, Moments(lo_all, hi_all, 0, nonfinite, 0.0, 0.0)
    mean_shifted = s1 / nf
    var = s2 / nf - mean_shifted * mean_shifted
    mean = shift + mean_shifted
    total = s1 + nf * shift
    if mean_shifted * mean_shifted > 1e6 * max(var, 0.0):
        # The shift was far from the mean (a skewed sample): sum again around the mean.
        r1, r2 = _centered_sums(a, mean, nonfinite > 0)
        mean, var, total = mean + r1 / nf, r2 / nf - (r1 / nf) ** 2, nf * mean + r1
    var = max(var, 0.0)
    rows = Rows(
        one(n),
        one(nf),
        one(zeros),
        one(mean),
        one(math.sqrt(var)),
        one(lo_all),
        one(hi_all),
        np.array([_quartiles(a, nf, bands)], dtype=np.float64),
        a[None, :],
        dims,
    )
    # sum(x^2) = n (var + mean^2): two non-negative terms, no cancellation.
    with np.errstate(all="ignore"):
        row = fill(rows, layout, metrics)[0]
    return row, Moments(lo_all, hi_all, nf, nonfinite, total, nf * (var + mean * mean))


def _centered_sums(a: np.ndarray, center: float, has_nonfinite: bool) -> tuple[float, float]:
    """``sum(x - center)`` and ``sum((x - center) ** 2)`` over the finite entries."""
    s1 = s2 = 0.0
    buf = np.empty(min(BLOCK, a.size), dtype=np.float64)
    for start in range(0, a.size, BLOCK):
        c = a[start : start + BLOCK]
        if has_nonfinite:
            c = c[np.isfinite(c)]
        d = buf[: c.size]
        np.subtract(c, center, out=d, dtype=np.float64)
        s1 += float(d.sum())
        s2 += float(np.einsum("i,i->", d, d))
    return s1, s2


def _quartiles(a: np.ndarray, nf: int, bands: list[_Band] | None) -> list[float]:
    out: list[float] = []
    positions = quantile_positions(nf)
    if bands is not None:
        for band, (lo, hi, frac) in zip(bands, positions, strict=True):
            found = band.values([lo] if hi == lo else [lo, hi])
            if found is None:
                break
            out.append(lerp(found[0], found[-1], frac))
            band.inside = np.empty(0)
        else:
            return out
    finite = a[np.isfinite(a)] if nf < a.size else a.copy()
    ranks = sorted({r for lo, hi, _ in positions for r in (lo, hi)})
    finite.partition(ranks)
    return [lerp(float(finite[lo]), float(finite[hi]), frac) for lo, hi, frac in positions]


def batched_rows(
    x: np.ndarray,
    numel: np.ndarray,
    layout: ProfileLayout = DEFAULT_LAYOUT,
    metrics: Mapping[str, NumpyMetric] = METRICS,
    last_dim: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Profile rows of the rows of ``x`` (float32 or float64, NaN-padded; the unpadded lengths
    are ``numel``), one small tensor per row. Sums are in float64.
    ``x`` is scratch: its rows are sorted in place, unless a metric reads entries in their
    order (:func:`reads_order`; ``last_dim``: each tensor's last dimension, default
    ``numel``). Also returns the sorted matrix: the first ``finite count`` entries of each of
    its rows are that row's finite values, ascending."""
    k, width = x.shape
    f64 = np.float64
    with np.errstate(all="ignore"):  # rows without finite entries give NaN, masked later
        sums = np.add.reduce(x, axis=1, dtype=f64)
        # Finite sums mean every entry is finite (NaN and inf propagate): the common case,
        # without padding, skips the masking passes.
        if np.isfinite(sums).all():
            nf = np.full(k, float(width))
            mean = sums / width
            d = np.subtract(x, mean[:, None], out=_scratch.take((k, width)))
            key = x.copy() if reads_order(layout, metrics) else x
        else:
            finite = np.isfinite(x)
            nf = np.count_nonzero(finite, axis=1).astype(f64)
            mean = np.add.reduce(np.where(finite, x, 0.0), axis=1, dtype=f64) / nf
            d = np.subtract(x, mean[:, None], out=_scratch.take((k, width)))
            d[~finite] = 0.0
            key = np.where(finite, x, x.dtype.type(math.inf))
        std = np.sqrt(np.einsum("ij,ij->i", d, d) / nf)
        if width < _SEARCH_ZEROS:
            zeros = np.count_nonzero(x == 0, axis=1)
        key.sort(axis=1)  # numpy's SIMD sort, in place: ``x`` is the caller's scratch matrix
        ordered = key
        if width >= _SEARCH_ZEROS:  # zeros (and -0.0) are one run of each sorted row
            # a zero of the rows' own dtype: a Python float would make numpy search a
            # float64 copy of each row
            zero = key.dtype.type(0)
            zeros = np.array(
                [np.searchsorted(r, zero, "right") - np.searchsorted(r, zero, "left") for r in key]
            )
        # numpy's "linear" quantile: positions q * (n - 1), interpolated between the two
        # neighbouring order statistics with numpy's ``_lerp`` (exact at both ends)
        last = np.maximum(nf - 1.0, 0.0)[:, None]
        pos = last * _QUANTILE_ARRAY
        lo = np.floor(pos)
        t = pos - lo
        idx = np.concatenate([last, lo, np.minimum(lo + 1.0, last)], axis=1).astype(np.intp)
        picked = np.take_along_axis(ordered, idx, axis=1).astype(f64)
        q = len(QUANTILES)
        a, b = picked[:, 1 : 1 + q], picked[:, 1 + q :]
        rows = Rows(
            numel=numel,
            finite=nf,
            zeros=zeros,
            mean=mean,
            std=std,
            lo=ordered[:, 0],
            hi=picked[:, 0],
            quartiles=lerp_array(a, b, t),
            entries=x,
            last_dim=numel if last_dim is None else last_dim,
            ordered=ordered,
        )
        return fill(rows, layout, metrics), ordered


__all__ = [
    "BLOCK",
    "METRICS",
    "PARALLEL_MIN",
    "Moments",
    "NumpyMetric",
    "Rows",
    "batched_rows",
    "fill",
    "in_halves",
    "reads_order",
    "reduce_large",
    "row_moments",
]
