"""The stability metrics' engine functions (``rms``, ``kurtosis``, ``max_abs``, declared in
``ti_schema.stability``) and a run's metric choice (``inject_observer(metrics=...)``).

``rms`` and ``max_abs`` follow from what every engine computes anyway (the mean, the
population std and the extremes of the finite entries, in float64): ``sqrt(std**2 + mean**2)``
(both terms non-negative: no cancellation) and ``max(|min|, |max|)``. ``kurtosis`` needs the
fourth central moment: one more pass over the entries, around the float64 mean, in pieces of at
most :data:`CHUNK` entries per row of a large tensor, so the temporary memory stays bounded.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Final

import numpy as np
import torch

from ti_core.reduction import metric_table, numpy_rows, torch_rows
from ti_core.reduction.engines import DEFAULT_ENGINES, MOMENT_METRICS, ProfileEngines
from ti_core.reduction.plan import (
    DefaultProfile,
    ReducerSpec,
    ReductionPlan,
    with_default_profile,
)
from ti_schema import (
    DEFAULT_METRICS,
    DEFAULT_PROFILE,
    STABILITY_METRICS,
    STABILITY_SPECS,
    MetricProfile,
)

CHUNK: Final = 1 << 20
"""Entries per piece of a large tensor's kurtosis pass."""


def _np_pieces(entries: np.ndarray) -> Iterator[np.ndarray]:
    if entries.shape[0] > 1 or entries.shape[1] <= CHUNK:
        yield entries
        return
    for start in range(0, entries.shape[1], CHUNK):
        yield entries[:, start : start + CHUNK]


def _np_kurtosis(rows: numpy_rows.Rows) -> np.ndarray:
    k = rows.entries.shape[0]
    s2, s4 = np.zeros(k), np.zeros(k)
    center = rows.mean[:, None]
    for piece in _np_pieces(rows.entries):
        x = piece.astype(np.float64, copy=False)
        d = np.where(np.isfinite(x), x - center, 0.0)
        d2 = d * d
        s2 += d2.sum(axis=1)
        s4 += (d2 * d2).sum(axis=1)
    m2, m4 = s2 / rows.finite, s4 / rows.finite
    with np.errstate(all="ignore"):
        result: np.ndarray = np.where(m2 > 0, m4 / (m2 * m2) - 3.0, np.nan)
    return result


def _t_kurtosis(rows: torch_rows.Rows) -> torch.Tensor:
    e = rows.entries
    pieces = [e] if e.shape[0] > 1 or e.shape[1] <= CHUNK else list(torch.split(e, CHUNK, 1))
    center = rows.mean.to(torch.float64)[:, None]
    s2 = torch.zeros_like(center[:, 0])
    s4 = torch.zeros_like(s2)
    for piece in pieces:
        x = piece.to(torch.float64)
        d = torch.where(torch.isfinite(x), x - center, 0.0)
        d2 = d * d
        s2 = s2 + d2.sum(1)
        s4 = s4 + (d2 * d2).sum(1)
    m2, m4 = s2 / rows.finite, s4 / rows.finite
    return torch.where(m2 > 0, m4 / (m2 * m2) - 3.0, math.nan)


# rms and max_abs follow from the rows (the shared table); kurtosis is a pass of each engine's
NUMPY: Final = {
    **metric_table.bind(metric_table.NUMPY_OPS, ("rms", "max_abs")),
    "kurtosis": _np_kurtosis,
}
TORCH: Final = {
    **metric_table.bind(metric_table.TORCH_OPS, ("rms", "max_abs")),
    "kurtosis": _t_kurtosis,
}


def check_metrics(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` (``inject_observer(metrics=...)``) checked: declared default or stability
    metrics, each once, with the four moments every profile keeps; in declaration order."""
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(
            f"metrics= must be a collection of metric names, e.g. (*DEFAULT_METRICS, "
            f"*STABILITY_METRICS), got {names!r}"
        )
    chosen = list(names)
    known = (*DEFAULT_METRICS, *STABILITY_METRICS)
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise ValueError(
            f"metrics= names unknown metric(s) {unknown}; the declared ones are {list(known)} "
            "(precision metrics come with precision=, custom ones with reducers=)"
        )
    missing = [n for n in MOMENT_METRICS if n not in chosen]
    if missing:
        raise ValueError(
            f"metrics= must keep {list(MOMENT_METRICS)} (histograms and shard combination "
            f"read them); missing {missing}"
        )
    return tuple(n for n in known if n in chosen)


def metric_engines(names: Sequence[str], base: ProfileEngines = DEFAULT_ENGINES) -> ProfileEngines:
    """Engines measuring exactly ``names`` (checked, :func:`check_metrics`) and whatever
    ``base`` adds beyond the default profile (precision metrics)."""
    specs = [m for m in (*DEFAULT_PROFILE, *STABILITY_SPECS) if m.name in names]
    extra = [m for m in base.metrics if m.name not in DEFAULT_PROFILE]
    return ProfileEngines(
        MetricProfile((*specs, *extra)),
        {**base.numpy, **NUMPY},
        {**base.torch, **TORCH},
    )


def with_metrics(reducers: Sequence[ReducerSpec], names: Iterable[str]) -> tuple[ReducerSpec, ...]:
    """``reducers`` whose default profile measures ``names`` (unchanged for the default
    nine). ValueError when a choice other than the default has no default profile to apply
    to."""
    chosen = check_metrics(names)
    if chosen == DEFAULT_METRICS:
        ReductionPlan(reducers)  # the reducers' own errors, as on any other choice
        return tuple(reducers)

    def change(spec: DefaultProfile) -> DefaultProfile:
        engines = metric_engines(chosen, spec.engines)
        return replace(spec, names=engines.metrics.names, engines=engines)

    return with_default_profile(
        reducers, change, f"metrics={list(chosen)!r} sets the default profile's metrics"
    )


__all__ = ["CHUNK", "check_metrics", "metric_engines", "with_metrics"]
