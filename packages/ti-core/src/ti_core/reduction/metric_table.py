"""The metrics that follow from an engine's rows, each written once for both engines.

Both engines learn the same things about each tensor (``Rows``: counts, float64 moments,
extremes, quartiles; :class:`ti_core.reduction.numpy_rows.Rows` for CPU tensors,
:class:`ti_core.reduction.torch_rows.Rows` on an accelerator). A metric that is arithmetic on
those is declared here once, against the few array functions the two libraries spell
differently (:class:`ArrayOps`), and each engine's table (``numpy_rows.METRICS``,
``torch_rows.METRICS``, the stability metrics' ``rms`` and ``max_abs``) is this table bound to
its library (:func:`bind`). Metrics that need a pass of their own over the entries (the
quartiles' selection, ``kurtosis``, the precision metrics) stay with their engine, because
the passes differ (numpy's blocks on the host, torch's chunks on the device).
packages/ti-core/tests/test_metric_table.py keeps the two bindings equal on the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

import numpy as np
import torch


@dataclass(frozen=True)
class ArrayOps:
    """The array functions a metric of this table may call, in one library."""

    sqrt: Callable[[Any], Any]
    maximum: Callable[[Any, Any], Any]
    abs: Callable[[Any], Any]


NUMPY_OPS: Final = ArrayOps(sqrt=np.sqrt, maximum=np.maximum, abs=np.abs)
TORCH_OPS: Final = ArrayOps(sqrt=torch.sqrt, maximum=torch.maximum, abs=torch.abs)

RowMetric = Callable[[Any, ArrayOps], Any]
"""A metric of ``k`` tensors: an engine's ``Rows`` and its library's functions to the ``(k,)``
column (an ndarray or a tensor, as the rows hold)."""

ROW_METRICS: Final[Mapping[str, RowMetric]] = MappingProxyType(
    {
        "mean": lambda r, ops: r.mean,
        "std": lambda r, ops: r.std,
        "min": lambda r, ops: r.lo,
        "max": lambda r, ops: r.hi,
        "p25": lambda r, ops: r.quartiles[:, 0],
        "p50": lambda r, ops: r.quartiles[:, 1],
        "p75": lambda r, ops: r.quartiles[:, 2],
        "zero_fraction": lambda r, ops: r.zeros / r.numel,
        "nonfinite_fraction": lambda r, ops: (r.numel - r.finite) / r.numel,
        # sum(x**2)/n = std**2 + mean**2 over the finite entries (population std): exact to
        # the float64 moments, both terms non-negative
        "rms": lambda r, ops: ops.sqrt(r.std * r.std + r.mean * r.mean),
        "max_abs": lambda r, ops: ops.maximum(ops.abs(r.lo), ops.abs(r.hi)),
    }
)
"""Every metric computed from ``Rows`` alone: the default profile's nine, ``rms`` and
``max_abs`` (``ti_schema.DEFAULT_PROFILE``, ``ti_schema.STABILITY_METRICS``)."""


def bind(ops: ArrayOps, names: tuple[str, ...]) -> Mapping[str, Callable[[Any], Any]]:
    """The metrics ``names`` of :data:`ROW_METRICS` as one engine's functions of its rows."""

    def bound(metric: RowMetric) -> Callable[[Any], Any]:
        return lambda rows: metric(rows, ops)

    return MappingProxyType({name: bound(ROW_METRICS[name]) for name in names})


__all__ = ["NUMPY_OPS", "ROW_METRICS", "TORCH_OPS", "ArrayOps", "RowMetric", "bind"]
