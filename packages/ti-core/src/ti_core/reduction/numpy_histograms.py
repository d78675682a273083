"""Histogram rows with numpy, on host memory (the numpy engine of the histograms).

Rows follow :mod:`~ti_core.reduction.layout` (histogram row). Edges are
``numpy.linspace(min, max, bins + 1)`` and the counts equal ``numpy.histogram`` on the finite
entries, bit for bit, by two routes:

- :func:`histograms_sorted`: from the sorted finite values and moments that the batched
  reduction of the same small tensors produced (no pass over the tensor at all);
- :func:`histogram_large`: one bucketing pass over the array, given the moments of a reduction
  of the same values (checked against the data as the buckets fill) or after a moments pass.
"""

from __future__ import annotations

import math

import numpy as np

from ti_core.reduction import layout
from ti_core.reduction.numpy_rows import BLOCK, Moments, in_halves


def _head(m: Moments) -> list[float]:
    """The histogram-row head of ``m``, in layout order."""
    head = [0.0] * layout.HISTOGRAM_HEAD
    head[layout.H_MIN] = m.lo
    head[layout.H_MAX] = m.hi
    head[layout.H_NUM] = m.finite
    head[layout.H_SUM] = m.total
    head[layout.H_SUM_SQUARES] = m.squares
    head[layout.H_NONFINITE] = m.nonfinite
    return head


def scan_moments(a: np.ndarray) -> Moments:
    """The moments of a 1-D float32/float64 array, in one blocked pass (float64 sums)."""
    n = a.size
    lo_all, hi_all = math.inf, -math.inf
    nonfinite = 0
    s1 = s2 = 0.0
    buf = np.empty(min(BLOCK, n), dtype=np.float64)
    for start in range(0, n, BLOCK):
        c = a[start : start + BLOCK]
        cmin, cmax = float(c.min()), float(c.max())
        if not (math.isfinite(cmin) and math.isfinite(cmax)):
            c = c[np.isfinite(c)]
            nonfinite += min(BLOCK, n - start) - c.size
            if c.size == 0:
                continue
            cmin, cmax = float(c.min()), float(c.max())
        lo_all, hi_all = min(lo_all, cmin), max(hi_all, cmax)
        d = buf[: c.size]
        d[...] = c
        s1 += float(d.sum())
        s2 += float(np.einsum("i,i->", d, d))
    return Moments(lo_all, hi_all, n - nonfinite, nonfinite, s1, s2)


def histogram_large(
    a: np.ndarray,
    bins: int,
    known: Moments | None = None,
    *,
    trusted: bool = False,
    parallel: bool = False,
) -> np.ndarray:
    """Histogram row of a 1-D float32/float64 array: the same edges and bucket rule as
    ``numpy.histogram(finite, bins=edges)``, with ``edges = linspace(min, max, bins + 1)``.

    ``known`` (from a reduction pass over the same values) saves the moments pass; it is
    checked against the data as the buckets are filled, and recomputed if it does not fit.
    ``trusted``: ``known`` comes from a pass over this very array (the reduction just before),
    so the per-block range check is skipped. ``parallel``: the pass may use a helper thread
    (:func:`~ti_core.reduction.numpy_rows.in_halves`).
    """
    m = known if known is not None else scan_moments(a)
    row = np.zeros(layout.histogram_width(bins))
    row[: layout.HISTOGRAM_HEAD] = _head(m)
    if m.finite == 0:
        return row
    edges = np.linspace(m.lo, m.hi, bins + 1)
    check = known is not None and not trusted
    counts = _bucket_counts(a, bins, m, edges, check, parallel)
    if counts is None:  # ``known`` did not describe this array
        if known is None:
            raise RuntimeError("the array changed while its histogram was being counted")
        return histogram_large(a, bins)
    row[layout.histogram_edges(bins)] = edges
    row[layout.histogram_counts(bins)] = counts
    return row


def _bucket_counts(
    a: np.ndarray, bins: int, m: Moments, edges: np.ndarray, check: bool, parallel: bool
) -> np.ndarray | None:
    width = m.hi - m.lo
    if not (width > 0 and math.isfinite(bins / width)):
        counts = np.zeros(bins, dtype=np.int64)
        counts[-1] = m.finite
        return counts
    parts = in_halves(
        a.size,
        lambda start, stop: _count_blocks(a[start:stop], bins, m, edges, check),
        parallel,
    )
    total = np.zeros(bins + 1, dtype=np.int64)  # [bins]: entries above the range
    seen = 0
    for part in parts:
        if part is None:
            return None
        total += part[0]
        seen += part[1]
    if seen != m.finite or total[bins]:
        return None
    return total[:bins]


def _count_blocks(
    a: np.ndarray, bins: int, m: Moments, edges: np.ndarray, check: bool
) -> tuple[np.ndarray, int] | None:
    """Bucket counts (``bins + 1``, the last for entries above the range) of the finite
    entries of ``a``, and how many there were; None when the moments do not fit them."""
    # Buckets are estimated in the array's own precision (float32 halves the memory traffic):
    # an entry is bucketed by truncating t -/+ eps, t = (x - min) * bins / width; where the two
    # disagree it lies within eps of an interior edge (or at the maximum, t = bins) and is
    # re-bucketed exactly against the float64 edges, as numpy.histogram would. Truncation keeps
    # entries at the minimum (t = 0) out of that slower path.
    width = m.hi - m.lo
    f32 = a.dtype == np.float32 and width < float(np.finfo(np.float32).max)
    work = np.dtype(np.float32 if f32 else np.float64)
    norm = work.type(bins / width)
    lo_w = work.type(m.lo)
    eps = work.type(max(1e-4, bins * 1e-6))
    counts = np.zeros(bins + 1, dtype=np.int64)
    block = max(min(BLOCK, a.size), 1)
    t = np.empty(block, dtype=work)
    shifted = np.empty(block, dtype=work)
    below = np.empty(block, dtype=np.int32)
    idx = np.empty(block, dtype=np.int32)
    seen = 0
    for start in range(0, a.size, BLOCK):
        c = a[start : start + BLOCK]
        if m.nonfinite:
            c = c[np.isfinite(c)]
        n = c.size
        if n == 0:
            continue
        if check and not (m.lo <= float(c.min()) and float(c.max()) <= m.hi):  # and NaN
            return None
        seen += n
        tc, sc, bc, ic = t[:n], shifted[:n], below[:n], idx[:n]
        np.subtract(c, lo_w, out=tc, dtype=work)
        tc *= norm
        np.copyto(bc, np.subtract(tc, eps, out=sc), casting="unsafe")
        np.copyto(ic, np.add(tc, eps, out=sc), casting="unsafe")
        try:
            found = np.bincount(ic, minlength=bins + 1)
        except ValueError:  # a negative bucket: the entries do not fit the moments
            return None
        if found.size > bins + 1:
            return None
        counts += found
        suspects = np.flatnonzero(bc != ic)
        if suspects.size:
            exact = np.searchsorted(edges, c[suspects].astype(np.float64), "right") - 1
            np.clip(exact, 0, bins - 1, out=exact)
            counts -= np.bincount(ic[suspects], minlength=bins + 1)
            counts += np.bincount(exact, minlength=bins + 1)
    return counts, seen


def histograms_sorted(rows: list[tuple[np.ndarray, Moments]], bins: int) -> np.ndarray:
    """Histogram rows (as :func:`histogram_large`, one per item) of tensors whose finite values
    are ``ordered`` (ascending; float32 or float64) with the moments ``m`` that the same
    reduction produced. Each bucket count is a difference of two binary searches for the
    float64 edges, so no entry is visited again; the edges of all rows are computed together.
    """
    k = len(rows)
    out = np.zeros((k, layout.histogram_width(bins)))
    if k == 0:
        return out
    out[:, : layout.HISTOGRAM_HEAD] = [_head(m) for _, m in rows]
    lo, hi = out[:, layout.H_MIN], out[:, layout.H_MAX]
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
    out[:, layout.histogram_edges(bins)] = edges
    inner = edges[:, 1:bins]
    # x < e exactly when x < (the smallest float32 >= e), for every float32 x
    with np.errstate(over="ignore", invalid="ignore"):
        up = inner.astype(np.float32)
        low = up.astype(np.float64) < inner
        up[low] = np.nextafter(up[low], np.float32(math.inf))
    counts = out[:, layout.histogram_counts(bins)]
    below = np.zeros(bins + 1, dtype=np.int64)  # [0] stays 0: nothing lies below the minimum
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


__all__ = ["histogram_large", "histograms_sorted", "scan_moments"]
