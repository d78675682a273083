"""The records a torchinstruments 0.8.0 sink receives: 0.8.0's own classes when it is installed,
else the look-alikes below (same fields, same names)."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from types import ModuleType
from typing import Any, Final

LEGACY_SCHEMA_VERSION: Final[int] = 6
"""``torchinstruments.records.SCHEMA_VERSION`` of 0.8.0, the record layout rebuilt here."""


@dataclass(frozen=True)
class Absent:
    """Carry the reason a canonical telemetry value is unavailable."""

    reason: str


@dataclass(frozen=True)
class SamplingRecord:
    type: str
    settings: dict[str, Any]


@dataclass(frozen=True)
class ReducerRecord:
    type: str
    settings: dict[str, Any]


@dataclass(frozen=True)
class CollectionRecord:
    invocation_capture: str
    signals: tuple[str, ...]
    scalar_reducers: tuple[ReducerRecord, ...]
    histogram_reducers: tuple[ReducerRecord, ...]
    histogram_modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunRecord:
    schema_version: int
    created_at: datetime
    torch_version: str
    observer_version: str
    sampling: SamplingRecord
    collection: CollectionRecord


@dataclass(frozen=True)
class ModuleRecord:
    type: str
    aliases: tuple[str, ...]
    parameter_count: int
    trainable_parameter_count: int


@dataclass(frozen=True)
class HistogramRecord:
    bin_edges: tuple[float, ...]
    bin_counts: tuple[int, ...]
    finite_count: int
    nonfinite_count: int
    underflow_count: int
    overflow_count: int
    minimum: float
    maximum: float
    sum: float
    sum_squares: float


@dataclass(frozen=True)
class TensorRecord:
    shape: tuple[int, ...]
    dtype: str
    device: str
    numel: int
    stats: dict[str, float]
    unavailable_stats: dict[str, str]
    histograms: dict[str, HistogramRecord]
    unavailable_histograms: dict[str, str]


@dataclass(frozen=True)
class ModuleCallRecord:
    call_index: int
    outputs: dict[str, TensorRecord]
    output_gradients: dict[str, TensorRecord]


@dataclass(frozen=True)
class ErrorRecord:
    timestamp: datetime
    module: str | Absent
    probe: str
    exception_type: str
    message: str


class SampleState(StrEnum):
    FORWARD_COMPLETE = "forward_complete"
    BACKWARD_OBSERVED = "backward_observed"


@dataclass(frozen=True)
class SampleRecord:
    schema_version: int
    sample_id: int
    forward_index: int
    timestamp: datetime
    state: SampleState
    collection_duration_ms: float
    modules: dict[str, tuple[ModuleCallRecord, ...]]
    errors: tuple[ErrorRecord, ...]


def record_types() -> ModuleType:
    """The module whose classes build the records: ``torchinstruments.records`` of 0.8.0 when it
    is installed and has that layout, else this module's look-alikes."""
    try:
        records = importlib.import_module("torchinstruments.records")
    except Exception:  # not installed, or it fails to import: the look-alikes serve
        return sys.modules[__name__]
    if getattr(records, "SCHEMA_VERSION", None) != LEGACY_SCHEMA_VERSION:
        return sys.modules[__name__]
    return records


__all__ = [
    "LEGACY_SCHEMA_VERSION",
    "Absent",
    "CollectionRecord",
    "ErrorRecord",
    "HistogramRecord",
    "ModuleCallRecord",
    "ModuleRecord",
    "ReducerRecord",
    "RunRecord",
    "SampleRecord",
    "SampleState",
    "SamplingRecord",
    "TensorRecord",
    "record_types",
]
