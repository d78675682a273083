"""Profile rows with torch, on the tensor's own device (the engine for accelerator tensors).

Rows follow :mod:`~ti_core.reduction.layout`; everything is float64 on the device and nothing
synchronizes with the host until the plan's single transfer per device, except
:func:`large_row_exact`, which decides on the host (it serves the rare retry).

- :func:`batched_rows`: small same-device tensors as the rows of one NaN-padded matrix.
- :func:`large_row_optimistic`: a large tensor, assuming every entry is finite (``kthvalue``
  on the raw values); the plan checks the finite count after the transfer and, when it is not
  the element count, redoes the tensor with :func:`large_row_exact`.

Each path computes what the profile's metrics are made of (:class:`Rows`), and one function
per metric (:data:`METRICS`) turns that into the metric's column (:func:`fill`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

import torch

from ti_core.reduction import metric_table
from ti_core.reduction import torch_select as sel
from ti_core.reduction.layout import DEFAULT_LAYOUT, ProfileLayout
from ti_core.reduction.quantiles import QUANTILES, lerp_tensor, quantile_positions
from ti_schema import DEFAULT_PROFILE


@dataclass(frozen=True)
class Rows:
    """What the torch engine learned about each of ``k`` tensors (one row each): float64
    ``(k,)`` tensors on the tensors' device; a metric function (:data:`METRICS`) turns it into
    that metric's ``(k,)`` column. As :class:`ti_core.reduction.numpy_rows.Rows`."""

    numel: torch.Tensor
    finite: torch.Tensor
    zeros: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    quartiles: torch.Tensor
    """``(k, 3)``."""
    entries: torch.Tensor
    """``(k, w)``: tensor ``r``'s entries in the first ``numel[r]`` places of row ``r``, NaN
    after them (any float dtype)."""
    last_dim: torch.Tensor | None = None
    """``(k,)``: the size of each tensor's last dimension (its element count for a 0-d or 1-D
    tensor), where a metric reads entries in their order (``entries`` then holds them in
    row-major order); None: the engine path did not record it (every tensor 1-D)."""
    ordered: torch.Tensor | None = None
    """``(k, w)``, where the path sorted anyway (the batched one): each row's finite entries
    ascending in its first ``finite`` places, ``+inf`` after them; None elsewhere."""
    cache: dict[object, object] = field(default_factory=dict, compare=False, repr=False)
    """What several metric functions of the same rows share (one pass for them all), keyed
    by the function family that computed it."""


TorchMetric = Callable[[Rows], torch.Tensor]
"""The torch engine's function of one metric: :class:`Rows` of ``k`` tensors to ``(k,)``."""

METRICS: Final[Mapping[str, TorchMetric]] = metric_table.bind(
    metric_table.TORCH_OPS, DEFAULT_PROFILE.names
)
"""One function per metric of ``ti_schema.DEFAULT_PROFILE``: the shared table
(:data:`ti_core.reduction.metric_table.ROW_METRICS`) bound to this engine."""


def fill(rows: Rows, layout: ProfileLayout, metrics: Mapping[str, TorchMetric]) -> torch.Tensor:
    """The ``(k, layout.width)`` float64 profile rows of ``rows``, on their device."""
    columns = [metrics[name](rows).to(torch.float64) for name in layout.metrics]
    return torch.stack([*columns, rows.finite], dim=1)


def _one(value: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """``value`` as a float64 ``(1,)`` tensor on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float64).reshape(1)
    return torch.tensor([value], dtype=torch.float64, device=device)


def batched_rows(
    parts: list[list[torch.Tensor]],
    device: torch.device,
    layout: ProfileLayout = DEFAULT_LAYOUT,
    metrics: Mapping[str, TorchMetric] = METRICS,
) -> torch.Tensor:
    """Profile rows of same-device small tensors, reduced together in float64 on the device.

    Each part holds tensors of one shape and dtype; the parts become the rows of one matrix,
    padded with NaN (neither finite nor zero) to the widest.
    """
    widths = [part[0].numel() for part in parts]
    width = max(widths)
    lengths = [w for part, w in zip(parts, widths, strict=True) for _ in part]
    dims = [float(part[0].shape[-1] if part[0].dim() else 1) for part in parts for _ in part]
    blocks = []
    for part, w in zip(parts, widths, strict=True):
        block = torch.stack(part).detach().reshape(len(part), w).to(torch.float64)
        if w < width:
            block = torch.nn.functional.pad(block, (0, width - w), value=math.nan)
        blocks.append(block)
    x = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    numel = torch.tensor(lengths, dtype=torch.float64).to(device, non_blocking=True)
    last_dim = torch.tensor(dims, dtype=torch.float64).to(device, non_blocking=True)
    return _matrix_rows(x, numel, layout, metrics, last_dim)


def _matrix_rows(
    x: torch.Tensor,
    numel: torch.Tensor,
    layout: ProfileLayout,
    metrics: Mapping[str, TorchMetric],
    last_dim: torch.Tensor | None = None,
) -> torch.Tensor:
    """Profile rows of the rows of the NaN-padded float64 matrix ``x`` (unpadded lengths
    ``numel``): :func:`ti_core.reduction.numpy_rows.batched_rows` in torch."""
    f64 = torch.float64
    finite = torch.isfinite(x)
    nf = finite.sum(1).to(f64)
    zeros = (x == 0).sum(1).to(f64)
    xf = torch.where(finite, x, 0.0)
    mean = xf.sum(1) / nf
    d = torch.where(finite, x - mean[:, None], 0.0)
    std = torch.sqrt((d * d).sum(1) / nf)
    ordered = torch.where(finite, x, math.inf).sort(dim=1).values
    last = (nf - 1).clamp(min=0)
    ranks = [last]
    fracs = []
    for q in QUANTILES:
        pos = q * last
        lo = pos.floor()
        ranks += [lo, torch.minimum(lo + 1, last)]
        fracs.append(pos - lo)
    picked = ordered.gather(1, torch.stack(ranks, dim=1).long())
    quartiles = torch.stack(
        [
            lerp_tensor(picked[:, 1 + 2 * j], picked[:, 2 + 2 * j], frac)
            for j, frac in enumerate(fracs)
        ],
        dim=1,
    )
    rows = Rows(
        numel, nf, zeros, mean, std, ordered[:, 0], picked[:, 0], quartiles, x, last_dim, ordered
    )
    return fill(rows, layout, metrics)


def large_row_exact(
    x: torch.Tensor,
    layout: ProfileLayout = DEFAULT_LAYOUT,
    metrics: Mapping[str, TorchMetric] = METRICS,
    last_dim: int | None = None,
) -> torch.Tensor:
    """The profile row of a large 1-D float tensor, deciding on the host. ``last_dim``: the
    last dimension of the tensor ``x`` flattens (row-major; default ``x.numel()``)."""
    f64 = torch.float64
    dev = x.device
    n = x.numel()
    dims = _one(float(n if last_dim is None else last_dim), dev)
    nonzero = torch.count_nonzero(x)
    mn, mx = torch.aminmax(x)
    if math.isfinite(float(mn)) and math.isfinite(float(mx)):
        v, nf = x, n
    else:
        v = x[torch.isfinite(x)]  # copies only the finite entries
        nf = v.numel()
        if nf:
            mn, mx = torch.aminmax(v)
    counts = (_one(n, dev), _one(float(nf), dev), _one(n - nonzero.to(f64), dev))
    if nf == 0:
        nan = _one(math.nan, dev)
        quartiles = torch.full((1, 3), math.nan, dtype=f64, device=dev)
        rows = Rows(*counts, nan, nan, nan, nan, quartiles, x[None, :], dims)
        return fill(rows, layout, metrics).reshape(-1)
    mean = sel.sum64(v) / nf
    std = torch.sqrt(sel.centered_sum_squares64(v, mean) / nf)
    positions = quantile_positions(nf)
    ranks = [r for lo, hi, _ in positions for r in (lo, hi)]
    stats = sel.order_statistics(v, ranks)
    quartiles = torch.stack(
        [
            lerp_tensor(stats[2 * j], stats[2 * j + 1], frac)
            for j, (_, _, frac) in enumerate(positions)
        ]
    ).reshape(1, -1)
    rows = Rows(
        *counts,
        _one(mean, dev),
        _one(std, dev),
        _one(mn, dev),
        _one(mx, dev),
        quartiles.to(f64),
        x[None, :],
        dims,
    )
    return fill(rows, layout, metrics).reshape(-1)


def large_row_optimistic(
    x: torch.Tensor,
    layout: ProfileLayout = DEFAULT_LAYOUT,
    metrics: Mapping[str, TorchMetric] = METRICS,
    last_dim: int | None = None,
) -> torch.Tensor:
    """Device-only profile row of a large 1-D float tensor whose order statistics assume every
    entry is finite (the plan checks the finite count after the transfer, redoes it if not);
    ``last_dim`` as for :func:`large_row_exact`."""
    f64 = torch.float64
    dev = x.device
    n = x.numel()
    finite = torch.isfinite(x)
    nf = finite.sum().to(f64)
    xz = torch.where(finite, x, 0.0)
    mean = sel.sum64(xz) / nf
    parts = []
    step = sel.chunk_size(x.device)
    for c, fc in zip(torch.split(xz, step), torch.split(finite, step), strict=True):
        d = torch.where(fc, c.to(f64) - mean, 0.0)
        parts.append(torch.dot(d, d))
    std = torch.sqrt(torch.stack(parts).sum() / nf)
    mn = torch.where(finite, x, math.inf).min().to(f64)
    mx = torch.where(finite, x, -math.inf).max().to(f64)
    quants = []
    for lo, hi, frac in quantile_positions(n):
        a = torch.kthvalue(x, lo + 1).values.to(f64)
        b = torch.kthvalue(x, hi + 1).values.to(f64) if hi != lo else a
        quants.append(lerp_tensor(a, b, frac))
    rows = Rows(
        _one(n, dev),
        _one(nf, dev),
        _one((x == 0).sum(), dev),
        _one(mean, dev),
        _one(std, dev),
        _one(mn, dev),
        _one(mx, dev),
        torch.stack(quants).reshape(1, -1).to(f64),
        x[None, :],
        _one(float(n if last_dim is None else last_dim), dev),
    )
    return fill(rows, layout, metrics).reshape(-1)


__all__ = [
    "METRICS",
    "Rows",
    "TorchMetric",
    "batched_rows",
    "fill",
    "large_row_exact",
    "large_row_optimistic",
]
