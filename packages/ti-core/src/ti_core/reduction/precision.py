"""The precision profile's engine functions: what a cast to bf16, fp16 or fp8 would lose.

The metrics are declared in ti-schema (:mod:`ti_schema.precision`); this module gives each one
its numpy and torch function (from the engines' ``Rows.entries``) and builds the extended
:class:`~ti_core.reduction.engines.ProfileEngines` (:func:`precision_engines`).

Exact by torch's own cast. Rounding to a format is monotone in the magnitude and symmetric in
the sign, so the entries that ``tensor.to(F)`` turns into zero are exactly those with
``|x| <= zero_max`` and those it turns into a non-zero subnormal exactly those with
``zero_max < |x| < normal_min``. Both bounds are found once per (entry dtype, format) by
bisection over the entry dtype's bit patterns with torch's cast itself (:func:`bounds`), so
the counting is comparisons on the entries (no cast per sample) and agrees with the cast to the
entry. ``overflow`` is ``|x| > torch.finfo(F).max`` over finite entries, as declared.

``mxfp8_e4m3`` (OCP MX v1.0): blocks of :data:`~ti_schema.precision.MX_BLOCK` consecutive
entries along the last dimension (a shorter last block), the shared scale
``2^clamp(floor(log2(block amax)) - 8, -127, 127)`` (the E8M0 range; block amax over the
block's finite entries), the entries divided by it exactly (a power of two, in float64) and
then counted as for ``float8_e4m3fn``; an entry whose scaled magnitude exceeds 448 saturates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from functools import cache
from typing import Final

import numpy as np
import torch

from ti_core.reduction import numpy_rows, torch_rows
from ti_core.reduction.engines import DEFAULT_ENGINES, ProfileEngines
from ti_core.reduction.plan import (
    DefaultProfile,
    ReducerSpec,
    ReductionPlan,
    with_default_profile,
)
from ti_schema import MetricSpec
from ti_schema.precision import (
    MIN_ABS_NONZERO,
    MX_BLOCK,
    MX_FORMATS,
    PRECISION_FORMATS,
    PRECISION_METRICS,
    check_formats,
    format_specs,
)

CHUNK: Final = 1 << 20
"""Entries per piece of a large tensor's row: the temporaries stay a few MiB."""

SORTED_MIN_WIDTH: Final = 256
"""From this row width on, a path that sorted its rows counts by binary search in them (two
per row for every format); narrower rows are compared entry by entry."""

ELEMENTWISE: Final[tuple[str, ...]] = tuple(f for f in PRECISION_FORMATS if f not in MX_FORMATS)
"""The formats cast entry by entry (every one but the block-scaled)."""

_MX_EMAX: Final = 8
"""The largest exponent of float8_e4m3fn (448 = 1.75 * 2^8)."""
_SCALE_RANGE: Final = 127
"""E8M0 scales are 2^-127 ... 2^127."""


def target_dtype(fmt: str) -> torch.dtype:
    """The torch dtype entries of ``fmt`` are cast to (the element dtype of an MX format)."""
    dtype = getattr(torch, MX_FORMATS.get(fmt, fmt), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"this torch ({torch.__version__}) has no dtype for the format {fmt!r}")
    return dtype


@cache
def bounds(entry: torch.dtype, fmt: str) -> tuple[float, float, float]:
    """``(zero_max, normal_min, max)`` of ``fmt`` for entries of dtype ``entry`` (float32 or
    float64): the largest positive entry that ``entry.to(F)`` makes zero, the smallest
    positive entry it makes a normal (or larger) value, and ``torch.finfo(F).max``."""
    dtype = target_dtype(fmt)
    info = torch.finfo(dtype)
    bits = torch.int32 if entry == torch.float32 else torch.int64
    top = int(torch.tensor([torch.finfo(entry).max], dtype=entry).view(bits))

    def first(predicate: Callable[[torch.Tensor], bool]) -> int:
        """The smallest positive bit pattern where ``predicate`` holds (monotone)."""
        lo, hi = 0, top
        while lo < hi:
            mid = (lo + hi) // 2
            if predicate(torch.tensor([mid], dtype=bits).view(entry)):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def value(pattern: int) -> float:
        return float(torch.tensor([pattern], dtype=bits).view(entry))

    nonzero = first(lambda v: bool(v.to(dtype).to(torch.float64)[0] != 0))
    normal = first(lambda v: bool(v.to(dtype).to(torch.float64).abs()[0] >= info.tiny))
    return value(nonzero - 1), value(normal), float(info.max)


def _entry_dtype(dtype: torch.dtype | np.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float32, np.float32) else torch.float64


# ----------------------------------------------------------------------------- numpy engine


def _np_pieces(rows: numpy_rows.Rows) -> Iterable[np.ndarray]:
    """``rows.entries`` in pieces of at most :data:`CHUNK` entries per row (a large tensor's
    one row is split; a batched matrix is small already)."""
    e = rows.entries
    width = e.shape[1]
    if e.shape[0] > 1 or width <= CHUNK:
        yield e
        return
    for start in range(0, width, CHUNK):
        yield e[:, start : start + CHUNK]


def _np_abs(rows: numpy_rows.Rows) -> list[np.ndarray] | None:
    """The magnitudes of the entries, computed once for every format (small rows only)."""
    if rows.entries.shape[0] == 1 and rows.entries.shape[1] > CHUNK:
        return None
    cached = rows.cache.get("abs")
    if cached is None:
        cached = rows.cache["abs"] = [np.abs(rows.entries)]
    assert isinstance(cached, list)
    return cached


def _probes(entry: torch.dtype) -> tuple[float, ...]:
    """What the sorted route looks up per row: ``-b`` for the bounds ``b`` of every
    elementwise format (in :data:`ELEMENTWISE` order, ``zero_max, normal_min, max`` each),
    then 0, then the same ``+b``."""
    pos = [b for fmt in ELEMENTWISE for b in bounds(entry, fmt)]
    return (*(-b for b in pos), 0.0, *pos)


def _sorted_results(
    left: np.ndarray, right: np.ndarray, finite: np.ndarray
) -> dict[str, np.ndarray]:
    """Counts per elementwise format from ``searchsorted`` of :func:`_probes` (left and right
    sides, ``(k, probes)``) in sorted rows with ``finite`` finite entries: ``|x| <= zero_max``
    is ``-zero_max <= x <= zero_max``, ``|x| < normal_min`` is ``-normal_min < x <
    normal_min``, a finite ``|x| > max`` is ``x > max`` among the finite or ``x < -max``."""
    half = 3 * len(ELEMENTWISE)
    out: dict[str, np.ndarray] = {}
    for i, fmt in enumerate(ELEMENTWISE):
        z, t, m = 3 * i, 3 * i + 1, 3 * i + 2
        at_most = right[:, half + 1 + z] - left[:, z]
        below = left[:, half + 1 + t] - right[:, t]
        over = finite - right[:, half + 1 + m] + left[:, m]
        out[fmt] = np.stack([at_most, below - at_most, over]).astype(np.float64)
    return out


def _np_sorted(rows: numpy_rows.Rows) -> dict[str, np.ndarray] | None:
    """Every elementwise format's counts and ``min_abs_nonzero`` from the sorted rows (two
    binary searches per row), where the path sorted them and they are wide enough for it."""
    o = rows.ordered
    if o is None or o.shape[1] < SORTED_MIN_WIDTH:
        return None
    got = rows.cache.get("sorted")
    if isinstance(got, dict):
        return got
    probes = np.asarray(_probes(_entry_dtype(o.dtype)), dtype=o.dtype)
    k = o.shape[0]
    left = np.empty((k, probes.size), dtype=np.int64)
    right = np.empty((k, probes.size), dtype=np.int64)
    for r in range(k):
        left[r] = np.searchsorted(o[r], probes, "left")
        right[r] = np.searchsorted(o[r], probes, "right")
    finite = rows.finite.astype(np.int64)
    out = _sorted_results(left, right, finite)
    zero = 3 * len(ELEMENTWISE)
    below_zero, above_zero = left[:, zero], right[:, zero]  # the zeros lie between
    rows_idx = np.arange(k)
    with np.errstate(invalid="ignore"):
        neg = np.where(below_zero > 0, -o[rows_idx, np.maximum(below_zero - 1, 0)], np.inf)
        pos = np.where(
            above_zero < finite, o[rows_idx, np.minimum(above_zero, o.shape[1] - 1)], np.inf
        )
    smallest = np.minimum(neg.astype(np.float64), pos.astype(np.float64))
    out["min_abs_nonzero"] = np.where(smallest < np.inf, smallest, np.nan)
    rows.cache["sorted"] = out
    return out


def _np_counts(rows: numpy_rows.Rows, fmt: str) -> np.ndarray:
    """``(3, k)`` counts of the entries that underflow, become subnormal, overflow in ``fmt``."""
    key = ("counts", fmt)
    got = rows.cache.get(key)
    if isinstance(got, np.ndarray):
        return got
    ordered = _np_sorted(rows) if fmt not in MX_FORMATS else None
    if ordered is not None:
        counts = ordered[fmt].copy()
        counts[0] -= rows.zeros
    elif fmt in MX_FORMATS:
        counts = _np_mx_counts(rows, fmt)
    else:
        kind = rows.entries.dtype.type
        zero_max, normal_min, top = (kind(b) for b in bounds(_entry_dtype(rows.entries.dtype), fmt))
        k = rows.entries.shape[0]
        counts = np.zeros((3, k))
        pieces = _np_abs(rows) or (np.abs(p) for p in _np_pieces(rows))
        for a in pieces:
            counts += _np_classify(a, zero_max, normal_min, top)
        counts[0] -= rows.zeros
    rows.cache[key] = counts
    return counts


def _np_classify(a: np.ndarray, zero_max: float, normal_min: float, top: float) -> np.ndarray:
    """Per row of magnitudes ``a`` (NaN padding counts nowhere): entries ``<= zero_max``
    (zeros included), ``zero_max < a < normal_min``, and ``top < a < inf``."""
    at_most = np.count_nonzero(a <= zero_max, axis=-1)
    below = np.count_nonzero(a < normal_min, axis=-1)
    over = np.count_nonzero(a > top, axis=-1) - np.count_nonzero(a == np.inf, axis=-1)
    return np.stack([at_most, below - at_most, over]).astype(np.float64)


def mx_pieces(numel: int, last: int) -> Iterator[tuple[int, int, int, int]]:
    """``(start, stop, lines, width)``: the flat entries ``[start, stop)`` of a tensor of
    ``numel`` entries and last dimension ``last``, as ``lines`` rows of ``width``, in pieces of
    about :data:`CHUNK` entries that split no MX block (whole rows of the last dimension, or a
    long row cut at multiples of :data:`CHUNK`, itself a multiple of the block)."""
    last = max(last, 1)
    outer = numel // last
    if last <= CHUNK:
        per = max(1, CHUNK // last)
        for first in range(0, outer, per):
            end = min(outer, first + per)
            yield first * last, end * last, end - first, last
        return
    for row in range(outer):
        for cut in range(0, last, CHUNK):
            width = min(CHUNK, last - cut)
            yield row * last + cut, row * last + cut + width, 1, width


def _np_mx_counts(rows: numpy_rows.Rows, fmt: str) -> np.ndarray:
    zero_max, normal_min, top = bounds(torch.float64, fmt)
    e = rows.entries
    k = e.shape[0]
    counts = np.zeros((3, k))
    numel = rows.numel.astype(np.int64)
    dims = (rows.last_dim if rows.last_dim is not None else rows.numel).astype(np.int64)
    groups: dict[tuple[int, int], list[int]] = {}
    for r in range(k):
        groups.setdefault((int(numel[r]), int(dims[r])), []).append(r)
    for (n, last), members in groups.items():
        idx = np.asarray(members)
        for start, stop, lines, width in mx_pieces(n, last):
            v = e[idx, start:stop]
            scaled = _np_mx_scaled(v.reshape(len(members), lines, width))
            got = _np_classify(np.abs(scaled.reshape(len(members), -1)), zero_max, normal_min, top)
            got[0] -= np.count_nonzero(v == 0, axis=-1)  # zeros stay zeros: not an underflow
            counts[:, idx] += got
    return counts


def _np_mx_scaled(v: np.ndarray) -> np.ndarray:
    """``(g, rows, last)`` entries divided by their MX block's scale, in float64, as
    ``(g, rows, blocks * 32)`` (NaN where a short last block is padded)."""
    g, outer, last = v.shape
    blocks = -(-last // MX_BLOCK)
    padded = np.full((g, outer, blocks * MX_BLOCK), np.nan)
    padded[:, :, :last] = v
    b = padded.reshape(g, outer, blocks, MX_BLOCK)
    with np.errstate(invalid="ignore"):
        mag = np.abs(b)
        amax = np.where(mag < np.inf, mag, 0.0).max(axis=-1)
    _, exponent = np.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1): floor(log2) = e - 1
    scale = np.clip(exponent.astype(np.int64) - 1 - _MX_EMAX, -_SCALE_RANGE, _SCALE_RANGE)
    scaled: np.ndarray = np.ldexp(b, -scale[..., None])
    return scaled.reshape(g, outer, blocks * MX_BLOCK)


def _np_min_abs_nonzero(rows: numpy_rows.Rows) -> np.ndarray:
    ordered = _np_sorted(rows)
    if ordered is not None:
        return ordered["min_abs_nonzero"]
    k = rows.entries.shape[0]
    out = np.full(k, np.inf)
    pieces = _np_abs(rows) or (np.abs(p) for p in _np_pieces(rows))
    for a in pieces:
        keep = (a > 0) & (a < np.inf)
        out = np.minimum(out, np.where(keep, a, np.inf).min(axis=-1))
    result: np.ndarray = np.where(out < np.inf, out, np.nan)
    return result


def _np_metric(fmt: str, which: int) -> numpy_rows.NumpyMetric:
    def metric(rows: numpy_rows.Rows) -> np.ndarray:
        column: np.ndarray = _np_counts(rows, fmt)[which] / rows.numel
        return column

    if fmt in MX_FORMATS:
        metric.reads_order = True  # type: ignore[attr-defined]
    return metric


# ----------------------------------------------------------------------------- torch engine


def _t_pieces(rows: torch_rows.Rows) -> Sequence[torch.Tensor]:
    e = rows.entries
    if e.shape[0] > 1 or e.shape[1] <= CHUNK:
        return [e]
    return list(torch.split(e, CHUNK, dim=1))


def _t_abs(rows: torch_rows.Rows) -> list[torch.Tensor] | None:
    e = rows.entries
    if e.shape[0] == 1 and e.shape[1] > CHUNK:
        return None
    cached = rows.cache.get("abs")
    if cached is None:
        cached = rows.cache["abs"] = [e.abs()]
    assert isinstance(cached, list)
    return cached


def _t_classify(a: torch.Tensor, zero_max: float, normal_min: float, top: float) -> torch.Tensor:
    at_most = (a <= zero_max).sum(-1)
    below = (a < normal_min).sum(-1)
    over = (a > top).sum(-1) - (a == math.inf).sum(-1)
    return torch.stack([at_most, below - at_most, over]).to(torch.float64)


def _t_sorted(rows: torch_rows.Rows) -> dict[str, torch.Tensor] | None:
    """As :func:`_np_sorted`, with one batched ``torch.searchsorted`` per side."""
    o = rows.ordered
    if o is None or o.shape[1] < SORTED_MIN_WIDTH:
        return None
    got = rows.cache.get("sorted")
    if isinstance(got, dict):
        return got
    k = o.shape[0]
    probes = torch.tensor(_probes(_entry_dtype(o.dtype)), dtype=o.dtype, device=o.device)
    probes = probes.expand(k, -1).contiguous()
    left = torch.searchsorted(o, probes)
    right = torch.searchsorted(o, probes, right=True)
    finite = rows.finite.to(torch.int64)
    half = 3 * len(ELEMENTWISE)
    out: dict[str, torch.Tensor] = {}
    for i, fmt in enumerate(ELEMENTWISE):
        z, t, m = 3 * i, 3 * i + 1, 3 * i + 2
        at_most = right[:, half + 1 + z] - left[:, z]
        below = left[:, half + 1 + t] - right[:, t]
        over = finite - right[:, half + 1 + m] + left[:, m]
        out[fmt] = torch.stack([at_most, below - at_most, over]).to(torch.float64)
    below_zero, above_zero = left[:, half], right[:, half]
    neg = -o.gather(1, (below_zero - 1).clamp(min=0)[:, None])[:, 0]
    pos = o.gather(1, above_zero.clamp(max=o.shape[1] - 1)[:, None])[:, 0]
    neg = torch.where(below_zero > 0, neg, math.inf)
    pos = torch.where(above_zero < finite, pos, math.inf)
    smallest = torch.minimum(neg, pos).to(torch.float64)
    out["min_abs_nonzero"] = torch.where(smallest < math.inf, smallest, math.nan)
    rows.cache["sorted"] = out
    return out


def _t_counts(rows: torch_rows.Rows, fmt: str) -> torch.Tensor:
    key = ("counts", fmt)
    got = rows.cache.get(key)
    if isinstance(got, torch.Tensor):
        return got
    ordered = _t_sorted(rows) if fmt not in MX_FORMATS else None
    if ordered is not None:
        zero = torch.zeros_like(rows.zeros)
        counts = ordered[fmt] - torch.stack([rows.zeros, zero, zero])
    elif fmt in MX_FORMATS:
        counts = _t_mx_counts(rows, fmt)
    else:
        zero_max, normal_min, top = bounds(_entry_dtype(rows.entries.dtype), fmt)
        pieces = _t_abs(rows) or [p.abs() for p in _t_pieces(rows)]
        parts = [_t_classify(a, zero_max, normal_min, top) for a in pieces]
        counts = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
        zero = torch.zeros_like(rows.zeros)
        counts = counts - torch.stack([rows.zeros, zero, zero])  # zeros are not underflows
    rows.cache[key] = counts
    return counts


def _t_mx_counts(rows: torch_rows.Rows, fmt: str) -> torch.Tensor:
    # Shapes decide the blocks, so they are read on the host (one small transfer; MX only).
    zero_max, normal_min, top = bounds(torch.float64, fmt)
    e = rows.entries
    k = e.shape[0]
    numel = rows.numel.to(torch.int64).tolist()
    dims = (rows.last_dim if rows.last_dim is not None else rows.numel).to(torch.int64).tolist()
    groups: dict[tuple[int, int], list[int]] = {}
    for r in range(k):
        groups.setdefault((numel[r], dims[r]), []).append(r)
    counts = torch.zeros((3, k), dtype=torch.float64, device=e.device)
    for (n, last), members in groups.items():
        idx = torch.tensor(members, device=e.device)
        for start, stop, lines, width in mx_pieces(n, last):
            v = e[:, start:stop].index_select(0, idx)
            scaled = _t_mx_scaled(v.reshape(len(members), lines, width))
            flat = scaled.reshape(len(members), -1)
            got = _t_classify(flat.abs(), zero_max, normal_min, top)
            got[0] -= (v == 0).sum(-1).to(torch.float64)  # zeros stay zeros
            counts[:, idx] += got
    return counts


def _t_mx_scaled(v: torch.Tensor) -> torch.Tensor:
    g, outer, last = v.shape
    blocks = -(-last // MX_BLOCK)
    b = torch.nn.functional.pad(v.to(torch.float64), (0, blocks * MX_BLOCK - last), value=math.nan)
    b = b.reshape(g, outer, blocks, MX_BLOCK)
    mag = b.abs()
    amax = torch.where(mag < math.inf, mag, 0.0).amax(-1)
    _, exponent = torch.frexp(amax)
    scale = (exponent.to(torch.int64) - 1 - _MX_EMAX).clamp(-_SCALE_RANGE, _SCALE_RANGE)
    factor = ((1023 - scale) << 52).view(torch.float64)  # 2^-scale, exactly
    return (b * factor[..., None]).reshape(g, outer, blocks * MX_BLOCK)


def _t_min_abs_nonzero(rows: torch_rows.Rows) -> torch.Tensor:
    ordered = _t_sorted(rows)
    if ordered is not None:
        return ordered["min_abs_nonzero"]
    pieces = _t_abs(rows) or [p.abs() for p in _t_pieces(rows)]
    parts = [torch.where((a > 0) & (a < math.inf), a, math.inf).amin(-1) for a in pieces]
    out = parts[0] if len(parts) == 1 else torch.stack(parts).amin(0)
    out = out.to(torch.float64)
    return torch.where(out < math.inf, out, math.nan)


def _t_metric(fmt: str, which: int) -> torch_rows.TorchMetric:
    def metric(rows: torch_rows.Rows) -> torch.Tensor:
        return _t_counts(rows, fmt)[which] / rows.numel

    return metric


# ----------------------------------------------------------------------------- the profile


def precision_engines(
    formats: Iterable[str], base: ProfileEngines = DEFAULT_ENGINES
) -> ProfileEngines:
    """``base`` with ``min_abs_nonzero`` and the metrics of each of ``formats`` (ValueError
    naming the valid formats for an unknown one; ``base`` itself when ``formats`` is empty)."""
    chosen = check_formats(formats)
    if not chosen:
        return base
    for fmt in chosen:
        target_dtype(fmt)
    engines = base
    specs: list[tuple[MetricSpec, numpy_rows.NumpyMetric, torch_rows.TorchMetric]] = [
        (MIN_ABS_NONZERO, _np_min_abs_nonzero, _t_min_abs_nonzero)
    ]
    for fmt in chosen:
        for which, spec in enumerate(format_specs(fmt)):
            assert spec.name.startswith(PRECISION_METRICS[which])
            specs.append((spec, _np_metric(fmt, which), _t_metric(fmt, which)))
    for spec, np_fn, t_fn in specs:
        if spec.name not in engines.metrics:
            engines = engines.extended(spec, numpy=np_fn, torch=t_fn)
    return engines


def with_precision(
    reducers: Sequence[ReducerSpec], formats: Iterable[str]
) -> tuple[ReducerSpec, ...]:
    """``reducers`` whose default profile also measures the precision metrics of ``formats``
    (unchanged when ``formats`` is empty). ValueError when there is no default profile to
    extend."""
    chosen = check_formats(formats)
    if not chosen:
        ReductionPlan(reducers)  # the reducers' own errors, as with any format
        return tuple(reducers)

    def change(spec: DefaultProfile) -> DefaultProfile:
        engines = precision_engines(chosen, spec.engines)
        added = tuple(n for n in engines.metrics.names if n not in spec.engines.metrics)
        return replace(spec, names=(*spec.names, *added), engines=engines)

    return with_default_profile(
        reducers, change, f"precision={chosen!r} extends the default profile"
    )


__all__ = ["CHUNK", "bounds", "mx_pieces", "precision_engines", "target_dtype", "with_precision"]
