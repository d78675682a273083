"""TensorBoard-style histograms of focus-layer tensors (definitions: docs/metrics.md).

Each histogram has ``bins`` equal-width buckets spanning the tensor's finite range, plus the
moments TensorBoard needs. CPU tensors are counted with numpy
(:mod:`~ti_core.reduction.numpy_histograms`), from what their reduction already learned when the
caller passes it; other tensors on their device with torch, all rows of one device coming back
to the host in one transfer. Rows follow :mod:`~ti_core.reduction.layout` (histogram row).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch

from ti_core.reduction import layout, support
from ti_core.reduction import torch_select as sel
from ti_core.reduction.numpy_histograms import histogram_large, histograms_sorted
from ti_core.reduction.numpy_rows import Moments
from ti_core.reduction.support import flat_float, unsupported_reason

__all__ = [
    "DEFAULT_BINS",
    "HistogramData",
    "HistogramRows",
    "compute_histograms",
    "histogram_rows",
    "single_value_limit",
]

DEFAULT_BINS: Final = 30
"""Buckets of every focus-layer histogram."""


@dataclass
class HistogramData:
    """One tensor's histogram, in the shape of a ``ti.histograms`` record.

    ``bucket_limits`` are right edges (ascending; the first bucket starts at ``min``) and
    ``bucket_counts`` the finite entries in each bucket. Buckets are closed on the left and
    open on the right, except the last, which also holds ``max``.
    """

    bucket_limits: np.ndarray
    bucket_counts: np.ndarray
    min: float | None
    max: float | None
    num: int
    sum: float
    sum_squares: float
    nonfinite_count: int


def single_value_limit(value: float) -> float:
    """Right edge of the one bucket of a single-valued tensor: ``value + 0.5`` when that is
    representable as a larger number, else the next float above ``value``."""
    right = value + 0.5
    return right if right > value and math.isfinite(right) else float(np.nextafter(value, math.inf))


@dataclass(frozen=True)
class HistogramRows:
    """Histograms of several tensors as one matrix of histogram rows
    (:mod:`~ti_core.reduction.layout`), ``bins`` buckets each: what the record batches are built
    from without a Python object per histogram. A row with ``num == 0`` is an empty histogram;
    one with ``min == max`` holds every entry in one bucket (see :class:`HistogramData`)."""

    rows: np.ndarray
    bins: int

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, index: Sequence[int]) -> HistogramRows:
        """The histograms at ``index``, in that order."""
        return HistogramRows(self.rows[np.asarray(index, dtype=np.intp)], self.bins)

    def items(self) -> list[HistogramData]:
        """Each histogram as a :class:`HistogramData`."""
        return [_from_row(row, self.bins) for row in self.rows]


def compute_histograms(
    tensors: Sequence[torch.Tensor],
    bins: int = DEFAULT_BINS,
    ordered: Sequence[tuple[np.ndarray, Moments] | None] | None = None,
    moments: Sequence[Moments | None] | None = None,
) -> list[HistogramData]:
    """Histograms of ``tensors`` with ``bins`` equal-width buckets over each finite range.

    Empty tensors, tensors without finite entries and tensors of dtypes the default profile
    cannot measure (complex, quantized, float8, ...) get an empty histogram (``num=0``, no
    buckets); their history rows carry the reason.

    What a reduction of the same values learned saves work on CPU tensors
    (:class:`~ti_core.reduction.plan.Measurements`): ``ordered[i]``, the finite values of tensor
    ``i`` in ascending order and their moments, means its histogram is counted from them
    without a pass over the tensor; ``moments[i]`` means one bucketing pass without a moments
    pass (moments that do not fit the data are detected and recomputed).
    """
    return histogram_rows(tensors, bins, ordered, moments).items()


def histogram_rows(
    tensors: Sequence[torch.Tensor],
    bins: int = DEFAULT_BINS,
    ordered: Sequence[tuple[np.ndarray, Moments] | None] | None = None,
    moments: Sequence[Moments | None] | None = None,
    *,
    trusted: bool = False,
    parallel: bool = False,
) -> HistogramRows:
    """:func:`compute_histograms` as one :class:`HistogramRows` (row ``i``: tensor ``i``).

    ``trusted``: ``moments`` come from the reduction of these very tensors just before (as in
    a :class:`~ti_core.reduction.batch.TensorBatch`), so the bucket pass does not check them
    block by block (the count of finite entries is still checked). ``parallel``: the caller
    waits for the result (the training thread), so a pass over a large CPU tensor may use a
    helper thread."""
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be a positive int, got {bins!r}; pass e.g. bins=30")
    width = layout.histogram_width(bins)
    out = np.zeros((len(tensors), width))  # all-zero rows: empty histograms
    pending: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    counted: list[tuple[int, tuple[np.ndarray, Moments]]] = []
    with torch.no_grad():
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"tensors[{i}] is a {type(t).__name__}; compute_histograms takes tensors"
                )
            if t.numel() == 0 or unsupported_reason(t) is not None:
                continue
            if support.uses_numpy(t.device):
                done = ordered[i] if ordered is not None and i < len(ordered) else None
                if done is not None:  # sorted by the reduction: counted from it, no pass
                    counted.append((i, done))
                    continue
                known = moments[i] if moments is not None and i < len(moments) else None
                out[i] = histogram_large(
                    flat_float(t).numpy(), bins, known, trusted=trusted, parallel=parallel
                )
            else:
                pending.setdefault(t.device, []).append((i, _device_row(t, bins)))
        if counted:
            out[[i for i, _ in counted]] = histograms_sorted([done for _, done in counted], bins)
        for items in pending.values():
            host = torch.cat([row for _, row in items]).cpu().numpy()  # one transfer per device
            out[[i for i, _ in items]] = host.reshape(len(items), width)
    return HistogramRows(out, bins)


def _empty(nonfinite: int) -> HistogramData:
    return HistogramData(
        bucket_limits=np.zeros(0, dtype=np.float64),
        bucket_counts=np.zeros(0, dtype=np.int64),
        min=None,
        max=None,
        num=0,
        sum=0.0,
        sum_squares=0.0,
        nonfinite_count=nonfinite,
    )


def _device_row(t: torch.Tensor, bins: int) -> torch.Tensor:
    """The histogram row of ``t`` with torch, on its device."""
    f64 = torch.float64
    x = flat_float(t)
    n = x.numel()
    finite = torch.isfinite(x)
    num = finite.sum().to(f64)
    xz = torch.where(finite, x, 0.0)
    total = sel.sum64(xz)
    squares = torch.stack(
        [torch.dot(c, c) for c in (p.to(f64) for p in torch.split(xz, sel.chunk_size(x.device)))]
    ).sum()
    mn = torch.where(finite, x, math.inf).min().to(f64)
    mx = torch.where(finite, x, -math.inf).max().to(f64)
    step = (mx - mn) / bins
    edges = torch.arange(bins + 1, dtype=f64, device=x.device) * step + mn
    edges[-1] = mx
    idx = torch.bucketize(x, edges[1:-1], right=True)
    counts = torch.zeros(bins, dtype=f64, device=x.device)
    counts.scatter_add_(0, idx.clamp_(max=bins - 1), finite.to(f64))
    head = [mn] * layout.HISTOGRAM_HEAD
    head[layout.H_MIN] = mn
    head[layout.H_MAX] = mx
    head[layout.H_NUM] = num
    head[layout.H_SUM] = total
    head[layout.H_SUM_SQUARES] = squares
    head[layout.H_NONFINITE] = n - num
    return torch.cat([torch.stack(head), edges, counts])


def _from_row(row: np.ndarray, bins: int) -> HistogramData:
    num = int(row[layout.H_NUM])
    nonfinite = int(row[layout.H_NONFINITE])
    if num == 0:
        return _empty(nonfinite)
    mn, mx = float(row[layout.H_MIN]), float(row[layout.H_MAX])
    if mn == mx:
        limits = np.array([single_value_limit(mx)], dtype=np.float64)
        counts = np.array([num], dtype=np.int64)
    else:
        right_edges = layout.histogram_edges(bins)
        limits = row[right_edges.start + 1 : right_edges.stop].astype(np.float64)
        counts = row[layout.histogram_counts(bins)].astype(np.int64)
    return HistogramData(
        bucket_limits=limits,
        bucket_counts=counts,
        min=mn,
        max=mx,
        num=num,
        sum=float(row[layout.H_SUM]),
        sum_squares=float(row[layout.H_SUM_SQUARES]),
        nonfinite_count=nonfinite,
    )
