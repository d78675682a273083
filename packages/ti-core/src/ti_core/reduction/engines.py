"""A metric declaration paired with each reduction engine's function per metric.

:class:`ProfileEngines` is what the default-profile reducer computes: the metrics of a
``ti_schema.MetricProfile`` (their layout derived from it, :class:`~ti_core.reduction.layout.
ProfileLayout`), one function per metric for the numpy engine (CPU tensors) and one for the
torch engine (accelerator tensors). A new metric in the default profile is its
``ti_schema.MetricSpec`` plus one entry in :data:`~ti_core.reduction.metric_table.ROW_METRICS`
(written once; :data:`~ti_core.reduction.numpy_rows.METRICS` and
:data:`~ti_core.reduction.torch_rows.METRICS` bind it to each engine);
:meth:`ProfileEngines.extended` builds the same for a copy, without touching the defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from ti_core.reduction import numpy_rows, torch_rows
from ti_core.reduction.layout import ProfileLayout
from ti_core.reduction.numpy_rows import NumpyMetric
from ti_core.reduction.torch_rows import TorchMetric
from ti_schema import DEFAULT_PROFILE, MetricProfile, MetricSpec

MOMENT_METRICS: Final[tuple[str, ...]] = ("mean", "std", "min", "max")
"""Metrics every profile keeps: a histogram of a tensor reuses them (``numpy_rows.Moments``)."""


@dataclass(frozen=True, eq=False)
class ProfileEngines:
    """The metrics of ``metrics`` and, for each, its numpy and its torch function."""

    metrics: MetricProfile = DEFAULT_PROFILE
    numpy: Mapping[str, NumpyMetric] = field(default_factory=lambda: numpy_rows.METRICS)
    torch: Mapping[str, TorchMetric] = field(default_factory=lambda: torch_rows.METRICS)
    layout: ProfileLayout = field(init=False)
    """The profile-row columns, derived from ``metrics``."""

    def __post_init__(self) -> None:
        names = self.metrics.names
        for engine, functions in (("numpy", self.numpy), ("torch", self.torch)):
            missing = [n for n in names if n not in functions]
            if missing:
                raise ValueError(
                    f"the {engine} engine has no function for the metric(s) {missing}; add "
                    f"one per metric to ProfileEngines({engine}=...)"
                )
        lacking = [n for n in MOMENT_METRICS if n not in names]
        if lacking:
            raise ValueError(
                f"a metric profile must keep {list(MOMENT_METRICS)} (histograms reuse them); "
                f"missing {lacking}"
            )
        object.__setattr__(self, "layout", ProfileLayout(self.metrics))

    def extended(
        self, spec: MetricSpec, *, numpy: NumpyMetric, torch: TorchMetric
    ) -> ProfileEngines:
        """A copy with the metric ``spec`` appended and its engine functions."""
        return ProfileEngines(
            self.metrics.extended([spec]),
            MappingProxyType({**self.numpy, spec.name: numpy}),
            MappingProxyType({**self.torch, spec.name: torch}),
        )


DEFAULT_ENGINES: Final[ProfileEngines] = ProfileEngines()
"""The default profile (``ti_schema.DEFAULT_PROFILE``) and the engines' built-in functions."""

__all__ = ["DEFAULT_ENGINES", "MOMENT_METRICS", "ProfileEngines"]
