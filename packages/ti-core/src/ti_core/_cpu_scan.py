"""One cache-blocked pass over a large CPU tensor: the default profile and histograms.

Private helpers of :mod:`ti_core.reducers` and :mod:`ti_core.histograms`. A large CPU tensor is
read from memory once, in blocks that fit the CPU cache, with numpy (SIMD comparisons, cheap
compaction). Quartiles are exact: a small random sample of the tensor (from a private
generator: the global RNG states never change) only chooses a narrow candidate band around
each quartile; the pass counts the entries below each band and collects the band, and the
wanted ranks are then read from the sorted band. A band that turns out not to hold its ranks
is replaced by an exact ``numpy.partition`` of the finite entries.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ti_core._selection import QUANTILES, quantile_positions

_BLOCK = 1 << 17
"""Entries per block: a float32 block and its float64 copy stay in a per-core cache."""

_SAMPLE_SIZE = 1 << 16
_SAMPLE_SEED = 0x7149_5EED

_SEARCH_ZEROS = 1 << 13
"""From this row width on, zeros are counted by binary search in the sorted rows."""

ROW = 10
"""mean, std, min, max, p25, p50, p75, zero_fraction, nonfinite_fraction, finite count."""


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
        self.inside: list[np.ndarray] = []

    def scan(self, c: np.ndarray) -> None:
        lo, hi = self.lo, self.hi
        ge = c >= lo
        n_ge = int(np.count_nonzero(ge))
        self.below += c.size - n_ge
        if lo == hi:
            self.at_lo += n_ge - int(np.count_nonzero(c > hi))
            return
        if self.tied:
            gt = c > lo
            self.at_lo += n_ge - int(np.count_nonzero(gt))
            lt = c < hi
            self.at_hi += int(np.count_nonzero(c == hi))
            ge = np.logical_and(gt, lt, out=gt)
        else:
            ge &= c <= hi
        idx = np.flatnonzero(ge)
        if idx.size:
            self.inside.append(c[idx])

    def value(self, rank: int, ordered: np.ndarray) -> float | None:
        """The value at ``rank`` of all finite entries, or None if the band misses it."""
        r = rank - self.below
        if r < 0:
            return None
        if r < self.at_lo:
            return self.lo
        r -= self.at_lo
        if r < ordered.size:
            return float(ordered[r])
        r -= ordered.size
        if r < self.at_hi:
            return self.hi
        return None


def _bands(a: np.ndarray) -> list[_Band] | None:
    """Sample-chosen candidate bands for the three quartiles (None: no finite sample)."""
    gen = np.random.default_rng(_SAMPLE_SEED)
    sample = a[gen.integers(0, a.size, _SAMPLE_SIZE)]
    sample = np.sort(sample[np.isfinite(sample)])
    m = sample.size
    if m == 0:
        return None
    out = []
    for q in QUANTILES:
        # Six standard errors of a sample quantile plus a few slots: a band misses its ranks
        # with negligible probability, and a miss only costs the exact fallback.
        margin = 6.0 * math.sqrt(max(q * (1.0 - q), 1.0 / m) / m) + 4.0 / m
        i_lo = max(math.floor((q - margin) * (m - 1)), 0)
        i_hi = min(math.ceil((q + margin) * (m - 1)), m - 1)
        lo = float(sample[i_lo]) if i_lo > 0 else -math.inf
        hi = float(sample[i_hi]) if i_hi < m - 1 else math.inf
        ends = sample[[i_lo, i_hi]]
        repeats = np.searchsorted(sample, ends, "right") - np.searchsorted(sample, ends, "left")
        out.append(_Band(lo, hi, tied=bool((repeats > 1).any())))
    return out


def reduce_large(a: np.ndarray) -> tuple[np.ndarray, Moments]:
    """Default-profile row (see ``ROW``) of a 1-D float32/float64 array, exact, and the
    moments a histogram of the same array needs."""
    n = a.size
    bands = _bands(a)
    # Shifting by a central value before summing keeps the one-pass variance exact in
    # float64: |mean - median| <= std, so E[(x - k)^2] is at most 2 var.
    shift = 0.0
    if bands is not None and math.isfinite(bands[1].lo) and math.isfinite(bands[1].hi):
        shift = 0.5 * (bands[1].lo + bands[1].hi)
    lo_all, hi_all = math.inf, -math.inf
    zeros = nonfinite = 0
    s1 = s2 = 0.0
    buf = np.empty(min(_BLOCK, n), dtype=np.float64)
    for start in range(0, n, _BLOCK):
        c = a[start : start + _BLOCK]
        zeros += int(np.count_nonzero(c == 0))
        cmin, cmax = float(c.min()), float(c.max())
        if not (math.isfinite(cmin) and math.isfinite(cmax)):
            c = c[np.isfinite(c)]
            nonfinite += min(_BLOCK, n - start) - c.size
            if c.size == 0:
                continue
            cmin, cmax = float(c.min()), float(c.max())
        lo_all, hi_all = min(lo_all, cmin), max(hi_all, cmax)
        d = buf[: c.size]
        np.subtract(c, shift, out=d, dtype=np.float64)
        s1 += float(d.sum())
        s2 += float(np.einsum("i,i->", d, d))  # not BLAS: no thread pool, no contention
        if bands is not None:
            for band in bands:
                band.scan(c)
    nf = n - nonfinite
    row = np.full(ROW, math.nan)
    row[7:] = (zeros / n, nonfinite / n, nf)
    if nf == 0:
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
    row[0], row[1], row[2], row[3] = mean, math.sqrt(var), lo_all, hi_all
    row[4:7] = _quartiles(a, nf, bands)
    # sum(x^2) = n (var + mean^2): two non-negative terms, no cancellation.
    return row, Moments(lo_all, hi_all, nf, nonfinite, total, nf * (var + mean * mean))


def _centered_sums(a: np.ndarray, center: float, has_nonfinite: bool) -> tuple[float, float]:
    """``sum(x - center)`` and ``sum((x - center) ** 2)`` over the finite entries."""
    s1 = s2 = 0.0
    buf = np.empty(min(_BLOCK, a.size), dtype=np.float64)
    for start in range(0, a.size, _BLOCK):
        c = a[start : start + _BLOCK]
        if has_nonfinite:
            c = c[np.isfinite(c)]
        d = buf[: c.size]
        np.subtract(c, center, out=d, dtype=np.float64)
        s1 += float(d.sum())
        s2 += float(np.einsum("i,i->", d, d))
    return s1, s2


def _quartiles(a: np.ndarray, nf: int, bands: list[_Band] | None) -> list[float]:
    out: list[float] = []
    missed = bands is None
    for j, (lo, hi, frac) in enumerate(quantile_positions(nf)):
        if bands is None:
            break
        band = bands[j]
        ordered = np.sort(np.concatenate(band.inside)) if band.inside else np.empty(0)
        band.inside = []
        va, vb = band.value(lo, ordered), band.value(hi, ordered)
        if va is None or vb is None:
            missed = True
            break
        out.append(_lerp(va, vb, frac))
    if not missed:
        return out
    finite = a[np.isfinite(a)] if nf < a.size else a.copy()
    positions = quantile_positions(nf)
    ranks = sorted({r for lo, hi, _ in positions for r in (lo, hi)})
    finite.partition(ranks)
    return [_lerp(float(finite[lo]), float(finite[hi]), frac) for lo, hi, frac in positions]


def _lerp(a: float, b: float, t: float) -> float:
    """numpy's ``_lerp`` (exact at both ends)."""
    diff = b - a
    return b - diff * (1.0 - t) if t >= 0.5 else a + diff * t


def batched_rows(x: np.ndarray, numel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Default-profile rows (see ``ROW``) of the rows of ``x`` (float32 or float64, NaN-padded;
    the unpadded lengths are ``numel``), one small tensor per row. Sums are in float64.
    ``x`` is scratch: its rows are sorted in place. Also returns the sorted matrix: the first
    ``finite count`` entries of each of its rows are that row's finite values, ascending."""
    k, width = x.shape
    f64 = np.float64
    out = np.empty((k, ROW))
    with np.errstate(all="ignore"):  # rows without finite entries give NaN, masked later
        sums = np.add.reduce(x, axis=1, dtype=f64)
        # Finite sums mean every entry is finite (NaN and inf propagate): the common case,
        # without padding, skips the masking passes.
        if np.isfinite(sums).all():
            nf = np.full(k, float(width))
            mean = sums / width
            d = np.subtract(x, mean[:, None], out=_scratch.take((k, width)))
            key = x
        else:
            finite = np.isfinite(x)
            nf = np.count_nonzero(finite, axis=1).astype(f64)
            mean = np.add.reduce(np.where(finite, x, 0.0), axis=1, dtype=f64) / nf
            d = np.subtract(x, mean[:, None], out=_scratch.take((k, width)))
            d[~finite] = 0.0
            key = np.where(finite, x, x.dtype.type(math.inf))
        out[:, 0] = mean
        out[:, 1] = np.sqrt(np.einsum("ij,ij->i", d, d) / nf)
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
        diff = b - a
        out[:, 2] = ordered[:, 0]
        out[:, 3] = picked[:, 0]
        out[:, 4 : 4 + q] = np.where(t >= 0.5, b - diff * (1.0 - t), a + diff * t)
        out[:, 7] = zeros / numel
        out[:, 8] = (numel - nf) / numel
        out[:, 9] = nf
    return out, ordered


HIST_HEAD = 6
"""min, max, num, sum, sum_squares, nonfinite count; then edges (bins + 1), counts (bins)."""


@dataclass(frozen=True)
class Moments:
    """What a reduction pass learned that a histogram of the same array needs."""

    lo: float
    hi: float
    finite: int
    nonfinite: int
    total: float
    squares: float


def _scan_moments(a: np.ndarray) -> Moments:
    n = a.size
    lo_all, hi_all = math.inf, -math.inf
    nonfinite = 0
    s1 = s2 = 0.0
    buf = np.empty(min(_BLOCK, n), dtype=np.float64)
    for start in range(0, n, _BLOCK):
        c = a[start : start + _BLOCK]
        cmin, cmax = float(c.min()), float(c.max())
        if not (math.isfinite(cmin) and math.isfinite(cmax)):
            c = c[np.isfinite(c)]
            nonfinite += min(_BLOCK, n - start) - c.size
            if c.size == 0:
                continue
            cmin, cmax = float(c.min()), float(c.max())
        lo_all, hi_all = min(lo_all, cmin), max(hi_all, cmax)
        d = buf[: c.size]
        d[...] = c
        s1 += float(d.sum())
        s2 += float(np.einsum("i,i->", d, d))
    return Moments(lo_all, hi_all, n - nonfinite, nonfinite, s1, s2)


def histogram_large(a: np.ndarray, bins: int, known: Moments | None = None) -> np.ndarray:
    """Histogram row of a 1-D float32/float64 array: the same edges and bucket rule as
    ``numpy.histogram(finite, bins=edges)``, with ``edges = linspace(min, max, bins + 1)``.

    ``known`` (from a reduction pass over the same values) saves the moments pass; it is
    checked against the data as the buckets are filled, and recomputed if it does not fit.
    """
    m = known if known is not None else _scan_moments(a)
    row = np.zeros(HIST_HEAD + 2 * bins + 1)
    row[:HIST_HEAD] = (m.lo, m.hi, m.finite, m.total, m.squares, m.nonfinite)
    if m.finite == 0:
        return row
    edges = np.linspace(m.lo, m.hi, bins + 1)
    counts = _bucket_counts(a, bins, m, edges)
    if counts is None:  # ``known`` did not describe this array
        return histogram_large(a, bins)
    row[HIST_HEAD : HIST_HEAD + bins + 1] = edges
    row[HIST_HEAD + bins + 1 :] = counts
    return row


def _bucket_counts(a: np.ndarray, bins: int, m: Moments, edges: np.ndarray) -> np.ndarray | None:
    width = m.hi - m.lo
    counts = np.zeros(bins, dtype=np.int64)
    if not (width > 0 and math.isfinite(bins / width)):
        counts[-1] = m.finite
        return counts
    # Buckets are estimated in the array's own precision (float32 halves the memory traffic):
    # an entry is bucketed by truncating t -/+ eps, t = (x - min) * bins / width; where the two
    # disagree it lies within eps of an interior edge and is re-bucketed exactly against the
    # float64 edges, as numpy.histogram would. Truncation keeps entries at the minimum (t = 0)
    # and clipping those at the maximum out of that slower path.
    f32 = a.dtype == np.float32 and width < float(np.finfo(np.float32).max)
    work = np.dtype(np.float32 if f32 else np.float64)
    norm = work.type(bins / width)
    lo_w = work.type(m.lo)
    eps = work.type(max(1e-4, bins * 1e-6))
    seen = 0
    for start in range(0, a.size, _BLOCK):
        c = a[start : start + _BLOCK]
        if m.nonfinite:
            c = c[np.isfinite(c)]
        if c.size == 0:
            continue
        if not (m.lo <= float(c.min()) and float(c.max()) <= m.hi):  # also catches NaN
            return None
        seen += c.size
        t = np.subtract(c, lo_w, dtype=work)
        t *= norm
        below = (t - eps).astype(np.int32)
        t += eps
        idx = t.astype(np.int32)
        np.minimum(idx, bins - 1, out=idx)
        counts += np.bincount(idx, minlength=bins)
        suspects = np.flatnonzero(below != idx)
        if suspects.size:
            exact = np.searchsorted(edges, c[suspects].astype(np.float64), "right") - 1
            np.clip(exact, 0, bins - 1, out=exact)
            counts -= np.bincount(idx[suspects], minlength=bins)
            counts += np.bincount(exact, minlength=bins)
    if seen != m.finite:
        return None
    return counts


def histograms_sorted(rows: list[tuple[np.ndarray, Moments]], bins: int) -> np.ndarray:
    """Histogram rows (as :func:`histogram_large`, one per item) of tensors whose finite values
    are ``ordered`` (ascending; float32 or float64) with the moments ``m`` that the same
    reduction produced. Each bucket count is a difference of two binary searches for the
    float64 edges, so no entry is visited again; the edges of all rows are computed together.
    """
    k = len(rows)
    out = np.zeros((k, HIST_HEAD + 2 * bins + 1))
    if k == 0:
        return out
    out[:, :HIST_HEAD] = [(m.lo, m.hi, m.finite, m.total, m.squares, m.nonfinite) for _, m in rows]
    lo, hi = out[:, 0], out[:, 1]
    # numpy.linspace(lo, hi, bins + 1) of each row, bit for bit (its scalar formula; a vector
    # call would switch every row to its zero-step formula as soon as one row has lo == hi)
    with np.errstate(invalid="ignore", over="ignore"):  # rows without finite values: unused
        delta = hi - lo
        step = delta / bins
        edges = np.arange(bins + 1, dtype=np.float64)[None, :] * step[:, None]
        edges += lo[:, None]
        edges[:, -1] = hi
    for tiny in np.flatnonzero((step == 0) & (delta != 0)):  # a subnormal step: numpy's path
        edges[tiny] = np.linspace(lo[tiny], hi[tiny], bins + 1)
    out[:, HIST_HEAD : HIST_HEAD + bins + 1] = edges
    inner = edges[:, 1:bins]
    # x < e exactly when x < (the smallest float32 >= e), for every float32 x
    with np.errstate(over="ignore", invalid="ignore"):
        up = inner.astype(np.float32)
        low = up.astype(np.float64) < inner
        up[low] = np.nextafter(up[low], np.float32(math.inf))
    counts = out[:, HIST_HEAD + bins + 1 :]
    below = np.empty(bins + 1, dtype=np.int64)
    below[0] = 0
    for r, (ordered, _) in enumerate(rows):
        nf = ordered.size
        if nf == 0:
            continue
        if lo[r] == hi[r]:
            counts[r, -1] = nf
            continue
        # bucket j holds edges[j] <= x < edges[j + 1]; the last one also holds the maximum
        below[1:bins] = np.searchsorted(
            ordered, up[r] if ordered.dtype == np.float32 else inner[r], "left"
        )
        below[bins] = nf
        counts[r] = np.diff(below)
    return out


def row_moments(row: np.ndarray, numel: int) -> Moments:
    """The moments implied by a default-profile row (see ``ROW``) of ``numel`` entries."""
    nf = int(row[9])
    mean, std = float(row[0]), float(row[1])
    return Moments(
        float(row[2]), float(row[3]), nf, numel - nf, mean * nf, (std * std + mean * mean) * nf
    )


_RECENT_MAX = 256
_recent: dict[int, tuple[weakref.ref[torch.Tensor], int, int, Moments]] = {}
"""Moments of the last large CPU tensors reduced, keyed by ``id``: the observer reduces a
snapshot and then histograms the same snapshot, which then needs no moments pass. An entry is
used only for the same live tensor object with the same version counter and storage pointer,
and the bucket pass still checks it against the data (range and finite count). A write that
bypasses the version counter (through ``.numpy()`` or ``.data``) and stays inside the recorded
range could leave ``sum``/``sum_squares`` stale; snapshots are never written to."""


def remember(t: torch.Tensor, m: Moments) -> None:
    """Record ``m`` as the moments of ``t``'s current values."""
    try:
        version = t._version
    except RuntimeError:  # inference tensors have no version counter
        return
    if len(_recent) >= _RECENT_MAX:
        _recent.pop(next(iter(_recent)))
    _recent[id(t)] = (weakref.ref(t), version, t.data_ptr(), m)


def recall(t: torch.Tensor) -> Moments | None:
    """The moments recorded for ``t`` if its values cannot have changed since."""
    entry = _recent.get(id(t))
    if entry is None:
        return None
    ref, version, ptr, m = entry
    try:
        same = ref() is t and t._version == version and t.data_ptr() == ptr
    except RuntimeError:
        same = False
    return m if same else None
