"""ti-schema: the TorchInstruments data contract (pyarrow only, never torch)."""

from __future__ import annotations

from ti_schema.names import (
    DEFAULT_METRICS,
    FINITE_METRICS,
    FRACTION_METRICS,
    METRIC_DEFINITIONS,
    MODES,
    SIGNALS,
)
from ti_schema.schemas import (
    DICTIONARY_COLUMNS,
    HISTOGRAMS,
    HISTORY,
    IDENTITY_COLUMNS,
    METADATA_KEY,
    histogram_schema,
    history_schema,
    schema_metadata,
)
from ti_schema.version import SCHEMA_VERSION

__all__ = [
    "DEFAULT_METRICS",
    "DICTIONARY_COLUMNS",
    "FINITE_METRICS",
    "FRACTION_METRICS",
    "HISTOGRAMS",
    "HISTORY",
    "IDENTITY_COLUMNS",
    "METADATA_KEY",
    "METRIC_DEFINITIONS",
    "MODES",
    "SCHEMA_VERSION",
    "SIGNALS",
    "histogram_schema",
    "history_schema",
    "schema_metadata",
]
