"""Exact order statistics and float64-accurate sums of large 1-D tensors with torch.

Used by the torch engine (:mod:`~ti_core.reduction.torch_rows`) and the torch histograms, on
the tensor's own device, without full sorts. Everything here is exact: sampling only places
narrow candidate bands (:mod:`~ti_core.reduction.bands`), every band is verified by counting
before it is trusted, and a band that does not hold the wanted ranks falls back to
``torch.kthvalue``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch

from ti_core.reduction.bands import SAMPLE_SEED, SAMPLE_SIZE, sample_span

_SORT_LIMIT: Final = 1 << 17
"""At or below this many entries a plain sort is cheaper than selection."""


def chunk_size(device: torch.device) -> int:
    """Elements per chunk for float64 accumulation: cache-sized on CPU, large on accelerators."""
    return 1 << 16 if device.type == "cpu" else 1 << 22


def sum64(v: torch.Tensor) -> torch.Tensor:
    """Sum of a 1-D tensor accumulated in float64, without a float64 copy of the whole tensor."""
    if v.dtype == torch.float64:
        return v.sum()
    step = chunk_size(v.device)
    if v.numel() <= step:
        return v.sum(dtype=torch.float64)
    parts = [c.sum(dtype=torch.float64) for c in torch.split(v, step)]
    return torch.stack(parts).sum()


def centered_sum_squares64(v: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``sum((v - mean) ** 2)`` in float64 (the second pass of a two-pass variance)."""
    step = chunk_size(v.device)
    parts = []
    for c in torch.split(v, step):
        d = c.to(torch.float64) - mean
        parts.append(torch.dot(d, d))
    return torch.stack(parts).sum()


def order_statistics(v: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    """Values at 0-based ``ranks`` of ascending-sorted ``v`` (1-D, all finite), as float64.

    Makes host decisions (counts are read back), so it suits CPU tensors, or accelerator
    tensors where a synchronization is acceptable.
    """
    n = v.numel()
    wanted = sorted(set(ranks))
    if n <= _SORT_LIMIT:
        ordered = torch.sort(v).values
        idx = torch.tensor(list(ranks), device=v.device)
        return ordered[idx].to(torch.float64)
    found: dict[int, torch.Tensor] = {}
    sample = _pivot_sample(v)
    m = sample.numel()
    for cluster in _clusters(wanted):
        got = _select_in_band(v, sample, m, cluster)
        if got is None:
            for r in cluster:
                found[r] = torch.kthvalue(v, r + 1).values
        else:
            found.update(got)
    return torch.stack([found[r] for r in ranks]).to(torch.float64)


def _pivot_sample(v: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator(device=v.device)
    gen.manual_seed(SAMPLE_SEED)
    idx = torch.randint(v.numel(), (SAMPLE_SIZE,), generator=gen, device=v.device)
    return torch.sort(v[idx]).values


def _clusters(ranks: list[int]) -> list[list[int]]:
    """Group ranks that are adjacent (the two neighbours of one quantile)."""
    groups: list[list[int]] = []
    for r in ranks:
        if groups and r - groups[-1][-1] <= 1:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def _select_in_band(
    v: torch.Tensor, sample: torch.Tensor, m: int, cluster: list[int]
) -> dict[int, torch.Tensor] | None:
    """Find ``cluster``'s ranks inside a sample-chosen band ``[lo, hi]``; None if they are not."""
    n = v.numel()
    i_lo, i_hi = sample_span(cluster[0] / (n - 1), cluster[-1] / (n - 1), m)
    lo = sample[i_lo] if i_lo >= 0 else None
    hi = sample[i_hi] if i_hi < m else None
    if lo is not None and hi is not None and bool(lo == hi):
        below = int(torch.count_nonzero(v < lo))
        through = n - int(torch.count_nonzero(v > hi))
        if below <= cluster[0] and cluster[-1] < through:
            return dict.fromkeys(cluster, lo)
        return None
    if lo is None:
        below = 0
        mask = v <= hi if hi is not None else torch.ones_like(v, dtype=torch.bool)
    else:
        mask = v >= lo
        below = n - int(torch.count_nonzero(mask))
        if hi is not None:
            mask &= v <= hi
    band = torch.masked_select(v, mask)
    del mask
    if not (below <= cluster[0] and cluster[-1] < below + band.numel()):
        return None
    ordered = torch.sort(band).values
    return {r: ordered[r - below] for r in cluster}


__all__ = ["centered_sum_squares64", "chunk_size", "order_statistics", "sum64"]
