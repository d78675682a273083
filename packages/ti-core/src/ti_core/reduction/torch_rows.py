"""Profile rows with torch, on the tensor's own device (the engine for accelerator tensors).

Rows follow :mod:`~ti_core.reduction.layout`; everything is float64 on the device and nothing
synchronizes with the host until the plan's single transfer per device, except
:func:`large_row_exact`, which decides on the host (it serves the rare retry).

- :func:`batched_rows`: small same-device tensors as the rows of one NaN-padded matrix.
- :func:`large_row_optimistic`: a large tensor, assuming every entry is finite (``kthvalue``
  on the raw values); the plan checks the finite count after the transfer and, when it is not
  the element count, redoes the tensor with :func:`large_row_exact`.
"""

from __future__ import annotations

import math

import torch

from ti_core.reduction import layout
from ti_core.reduction import torch_select as sel
from ti_core.reduction.quantiles import QUANTILES, lerp_tensor, quantile_positions


def batched_rows(parts: list[list[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Profile rows of same-device small tensors, reduced together in float64 on the device.

    Each part holds tensors of one shape and dtype; the parts become the rows of one matrix,
    padded with NaN (neither finite nor zero) to the widest.
    """
    widths = [part[0].numel() for part in parts]
    width = max(widths)
    lengths = [w for part, w in zip(parts, widths, strict=True) for _ in part]
    blocks = []
    for part, w in zip(parts, widths, strict=True):
        block = torch.stack(part).detach().reshape(len(part), w).to(torch.float64)
        if w < width:
            block = torch.nn.functional.pad(block, (0, width - w), value=math.nan)
        blocks.append(block)
    x = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    numel = torch.tensor(lengths, dtype=torch.float64).to(device, non_blocking=True)
    return _matrix_rows(x, numel)


def _matrix_rows(x: torch.Tensor, numel: torch.Tensor) -> torch.Tensor:
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
    p25, p50, p75 = (
        lerp_tensor(picked[:, 1 + 2 * j], picked[:, 2 + 2 * j], frac)
        for j, frac in enumerate(fracs)
    )
    columns = {
        layout.MEAN: mean,
        layout.STD: std,
        layout.MIN: ordered[:, 0],
        layout.MAX: picked[:, 0],
        layout.P25: p25,
        layout.P50: p50,
        layout.P75: p75,
        layout.ZERO_FRACTION: zeros / numel,
        layout.NONFINITE_FRACTION: (numel - nf) / numel,
        layout.FINITE_COUNT: nf,
    }
    return torch.stack(layout.in_order(columns), dim=1)


def large_row_exact(x: torch.Tensor) -> torch.Tensor:
    """The profile row of a large 1-D float tensor, deciding on the host."""
    f64 = torch.float64
    n = x.numel()
    nonzero = torch.count_nonzero(x)
    mn, mx = torch.aminmax(x)
    if math.isfinite(float(mn)) and math.isfinite(float(mx)):
        v, nf = x, n
    else:
        v = x[torch.isfinite(x)]  # copies only the finite entries
        nf = v.numel()
        if nf:
            mn, mx = torch.aminmax(v)
    fractions = {
        layout.ZERO_FRACTION: ((n - nonzero.to(f64)) / n).to(x.device),
        layout.NONFINITE_FRACTION: torch.tensor((n - nf) / n, dtype=f64, device=x.device),
        layout.FINITE_COUNT: torch.tensor(float(nf), dtype=f64, device=x.device),
    }
    if nf == 0:
        nan = torch.tensor(math.nan, dtype=f64, device=x.device)
        return torch.stack(layout.in_order({**dict.fromkeys(layout.OVER_FINITE, nan), **fractions}))
    mean = sel.sum64(v) / nf
    std = torch.sqrt(sel.centered_sum_squares64(v, mean) / nf)
    positions = quantile_positions(nf)
    ranks = [r for lo, hi, _ in positions for r in (lo, hi)]
    stats = sel.order_statistics(v, ranks)
    p25, p50, p75 = (
        lerp_tensor(stats[2 * j], stats[2 * j + 1], frac)
        for j, (_, _, frac) in enumerate(positions)
    )
    columns = {
        layout.MEAN: mean,
        layout.STD: std,
        layout.MIN: mn.to(f64),
        layout.MAX: mx.to(f64),
        layout.P25: p25,
        layout.P50: p50,
        layout.P75: p75,
        **fractions,
    }
    return torch.stack(layout.in_order(columns))


def large_row_optimistic(x: torch.Tensor) -> torch.Tensor:
    """Device-only profile row of a large 1-D float tensor whose order statistics assume every
    entry is finite (the plan checks the finite count after the transfer, redoes it if not)."""
    f64 = torch.float64
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
    p25, p50, p75 = quants
    columns = {
        layout.MEAN: mean,
        layout.STD: std,
        layout.MIN: mn,
        layout.MAX: mx,
        layout.P25: p25,
        layout.P50: p50,
        layout.P75: p75,
        layout.ZERO_FRACTION: (x == 0).sum().to(f64) / n,
        layout.NONFINITE_FRACTION: (n - nf) / n,
        layout.FINITE_COUNT: nf,
    }
    return torch.stack(layout.in_order(columns))


__all__ = ["batched_rows", "large_row_exact", "large_row_optimistic"]
