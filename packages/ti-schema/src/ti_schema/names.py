"""Names shared by every producer and reader: signals and the default metric profile."""

from __future__ import annotations

from typing import Final, Literal, get_args

# The metric profile is declared in ti_schema.metrics; its names are re-exported here.
from ti_schema.metrics import (
    DEFAULT_METRICS,
    FINITE_METRICS,
    FRACTION_METRICS,
    METRIC_DEFINITIONS,
)

# The signals are declared in ti_schema.signals; their names are re-exported here.
from ti_schema.signals import (
    DEFAULT_SIGNALS,
    PARAMETER_SIGNALS,
    SIGNAL_ADDED_IN,
    SIGNAL_DEFINITIONS,
    SIGNALS,
    Signal,
)

Mode = Literal["train", "eval"]
"""A value of the ``mode`` column."""

MODES: Final[tuple[Mode, ...]] = get_args(Mode)
"""Values of the ``mode`` column: the module's own ``training`` flag at the call."""

__all__ = [
    "DEFAULT_METRICS",
    "DEFAULT_SIGNALS",
    "FINITE_METRICS",
    "FRACTION_METRICS",
    "METRIC_DEFINITIONS",
    "MODES",
    "PARAMETER_SIGNALS",
    "SIGNALS",
    "SIGNAL_ADDED_IN",
    "SIGNAL_DEFINITIONS",
    "Mode",
    "Signal",
]
