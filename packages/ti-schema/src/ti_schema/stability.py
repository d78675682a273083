"""The stability metrics (contract 1.5, opt-in): what the training-instability literature
watches before a run diverges, on any signal.

- ``rms``: the root mean square of the finite entries (Rybakov et al. 2024: the RMS of linear
  layers' outputs grows before divergence; Wortsman et al. 2023: the update RMS);
- ``kurtosis``: the excess kurtosis (Fisher's) of the finite entries, population moments
  (He et al. 2024 and the outlier-feature work: outlier features raise it);
- ``max_abs``: the largest magnitude of the finite entries (what a low-precision format clips).

A producer records them when asked (ti-core: ``inject_observer(metrics=(*DEFAULT_METRICS,
*STABILITY_METRICS))``); docs/metrics.md gives each one's query.
"""

from __future__ import annotations

from typing import Final

from ti_schema.metrics import MetricSpec

RMS: Final[MetricSpec] = MetricSpec(
    "rms",
    "root mean square of the finite entries: sqrt(mean(x**2))",
    "finite",
    combine="root_mean_square",
)
KURTOSIS: Final[MetricSpec] = MetricSpec(
    "kurtosis",
    "excess kurtosis (Fisher's) of the finite entries: m4 / m2**2 - 3, population central moments",
    "finite",
    not_combinable=(
        "the excess kurtosis of a sharded tensor needs each shard's second, third and fourth "
        "central moments, which the rows do not hold"
    ),
    null_reason="constant finite entries (zero variance): kurtosis is undefined",
)
MAX_ABS: Final[MetricSpec] = MetricSpec(
    "max_abs",
    "largest magnitude of the finite entries: max(|min|, |max|)",
    "finite",
    combine="max",
)
STABILITY_SPECS: Final[tuple[MetricSpec, ...]] = (RMS, KURTOSIS, MAX_ABS)
STABILITY_METRICS: Final[tuple[str, ...]] = tuple(m.name for m in STABILITY_SPECS)
"""``("rms", "kurtosis", "max_abs")``."""

__all__ = ["KURTOSIS", "MAX_ABS", "RMS", "STABILITY_METRICS", "STABILITY_SPECS"]
