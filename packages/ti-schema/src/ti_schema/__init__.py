"""ti-schema: the TorchInstruments data contract (pyarrow only, never torch).

The Arrow schemas, names and versioning of the data; the producer/sink contract (``Sink``,
``RunInfo``, ``RankPolicy``, ...); the on-disk layout of a run (:mod:`ti_schema.layout`);
validators, the artifact-directory checker (:mod:`ti_schema.artifacts`) and a conformance kit
(:mod:`ti_schema.testing`).
"""

from __future__ import annotations

from ti_schema.compat import (
    KNOWN_VERSIONS,
    OPTIONAL_KEYS,
    check_compatible,
    parse_metadata,
    parse_version,
)
from ti_schema.cost import COST_METHOD, RunCost
from ti_schema.errors import MISMATCH_KINDS, Mismatch, MismatchKind, SchemaMismatchError
from ti_schema.events import (
    EVENT_COLUMNS,
    EVENT_KINDS,
    REPLAY_VERDICTS,
    EventKind,
    ReplayVerdict,
    empty_events,
    events_schema,
)
from ti_schema.interop import footer_metadata, large_types, polars_write_options
from ti_schema.metrics import (
    COMBINE_RULES,
    DEFAULT_PROFILE,
    Combine,
    MetricProfile,
    MetricSpec,
)
from ti_schema.names import (
    DEFAULT_METRICS,
    DEFAULT_SIGNALS,
    FINITE_METRICS,
    FRACTION_METRICS,
    METRIC_DEFINITIONS,
    MODES,
    PARAMETER_SIGNALS,
    SIGNAL_ADDED_IN,
    SIGNAL_DEFINITIONS,
    SIGNALS,
    Mode,
    Signal,
)
from ti_schema.precision import (
    FULL_PRECISION_PROFILE,
    PRECISION_FORMATS,
    PRECISION_METRICS,
    PrecisionFormat,
    declared_metric,
    metric_name_problem,
    precision_profile,
    profile_of,
)
from ti_schema.ranks import RankPolicy, RankSelection
from ti_schema.result_json import RESULT_JSON_SCHEMA, validate_result_json
from ti_schema.schemas import (
    DICTIONARY_COLUMNS,
    EVENTS,
    HISTOGRAMS,
    HISTORY,
    IDENTITY_COLUMNS,
    METADATA_KEY,
    PLACEHOLDERS,
    SCHEMA_NAMES,
    UNRECORDABLE_COLUMNS,
    SchemaName,
    histogram_schema,
    history_schema,
    schema_metadata,
)
from ti_schema.signals import SIGNAL_DECLARATION, SignalDeclaration, SignalSpec
from ti_schema.sink import (
    Barrier,
    DeclaresCapabilities,
    LayerInfo,
    RunInfo,
    Sink,
    SinkCapabilities,
    sink_capabilities,
)
from ti_schema.validate import (
    type_matches,
    validate_events,
    validate_histograms,
    validate_history,
)
from ti_schema.version import SCHEMA_VERSION

__all__ = [
    "COMBINE_RULES",
    "COST_METHOD",
    "DEFAULT_METRICS",
    "DEFAULT_PROFILE",
    "DEFAULT_SIGNALS",
    "DICTIONARY_COLUMNS",
    "EVENTS",
    "EVENT_COLUMNS",
    "EVENT_KINDS",
    "FINITE_METRICS",
    "FRACTION_METRICS",
    "FULL_PRECISION_PROFILE",
    "HISTOGRAMS",
    "HISTORY",
    "IDENTITY_COLUMNS",
    "KNOWN_VERSIONS",
    "METADATA_KEY",
    "METRIC_DEFINITIONS",
    "MISMATCH_KINDS",
    "MODES",
    "OPTIONAL_KEYS",
    "PARAMETER_SIGNALS",
    "PLACEHOLDERS",
    "PRECISION_FORMATS",
    "PRECISION_METRICS",
    "REPLAY_VERDICTS",
    "RESULT_JSON_SCHEMA",
    "SCHEMA_NAMES",
    "SCHEMA_VERSION",
    "SIGNALS",
    "SIGNAL_ADDED_IN",
    "SIGNAL_DECLARATION",
    "SIGNAL_DEFINITIONS",
    "UNRECORDABLE_COLUMNS",
    "Barrier",
    "Combine",
    "DeclaresCapabilities",
    "EventKind",
    "LayerInfo",
    "MetricProfile",
    "MetricSpec",
    "Mismatch",
    "MismatchKind",
    "Mode",
    "PrecisionFormat",
    "RankPolicy",
    "RankSelection",
    "ReplayVerdict",
    "RunCost",
    "RunInfo",
    "SchemaMismatchError",
    "SchemaName",
    "Signal",
    "SignalDeclaration",
    "SignalSpec",
    "Sink",
    "SinkCapabilities",
    "check_compatible",
    "declared_metric",
    "empty_events",
    "events_schema",
    "footer_metadata",
    "histogram_schema",
    "history_schema",
    "large_types",
    "metric_name_problem",
    "parse_metadata",
    "parse_version",
    "polars_write_options",
    "precision_profile",
    "profile_of",
    "schema_metadata",
    "sink_capabilities",
    "type_matches",
    "validate_events",
    "validate_histograms",
    "validate_history",
    "validate_result_json",
]
