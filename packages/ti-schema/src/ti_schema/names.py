"""Names shared by every producer and reader: signals and the default metric profile."""

from __future__ import annotations

from typing import Final, Literal, get_args

Signal = Literal["output", "output_gradient", "parameter", "parameter_gradient", "parameter_update"]
"""A value of the ``signal`` column."""
Mode = Literal["train", "eval"]
"""A value of the ``mode`` column."""

SIGNALS: Final[tuple[Signal, ...]] = get_args(Signal)
"""Values of the ``signal`` column, in the order readers list them: a module's output, the
gradient with respect to it, and (contract 1.2) the module's own parameters, their gradients and
their updates."""

DEFAULT_SIGNALS: Final[tuple[Signal, ...]] = ("output", "output_gradient")
"""What a producer records unless asked for more (ti-core's ``inject_observer(signals=)``)."""

PARAMETER_SIGNALS: Final[tuple[Signal, ...]] = (
    "parameter",
    "parameter_gradient",
    "parameter_update",
)
"""The opt-in signals about a module's directly owned parameters (``tensor_path`` = the
parameter's name in the module, e.g. ``weight``)."""

SIGNAL_ADDED_IN: Final[dict[Signal, int]] = {
    "output": 0,
    "output_gradient": 0,
    "parameter": 2,
    "parameter_gradient": 2,
    "parameter_update": 2,
}
"""Minor contract version (of major 1) that introduced each signal value."""

SIGNAL_DEFINITIONS: Final[dict[Signal, str]] = {
    "output": "a tensor in the output of a selected module's call",
    "output_gradient": "the gradient with respect to that output, from the first backward that "
    "reaches it",
    "parameter": "a parameter the module owns directly, as the sampled forward used it",
    "parameter_gradient": "that parameter's .grad at the end of the first backward that reaches "
    "the sampled forward (accumulated micro-batches included)",
    "parameter_update": "value after minus value before the first optimizer step that follows "
    "the sampled forward",
}
"""One-line definition of each signal, for docs and index.md."""

MODES: Final[tuple[Mode, ...]] = get_args(Mode)
"""Values of the ``mode`` column: the module's own ``training`` flag at the call."""

FINITE_METRICS: Final[tuple[str, ...]] = ("mean", "std", "min", "max", "p25", "p50", "p75")
"""Metrics computed over the finite entries of a tensor (std is the population std)."""

FRACTION_METRICS: Final[tuple[str, ...]] = ("zero_fraction", "nonfinite_fraction")
"""Metrics computed over all entries; the denominator is the original element count."""

DEFAULT_METRICS: Final[tuple[str, ...]] = FINITE_METRICS + FRACTION_METRICS
"""The default metric profile, in the order producers emit it."""

METRIC_DEFINITIONS: Final[dict[str, str]] = {
    "mean": "arithmetic mean of the finite entries",
    "std": "population standard deviation (ddof=0) of the finite entries",
    "min": "smallest finite entry",
    "max": "largest finite entry",
    "p25": "25th percentile of the finite entries, linear interpolation (numpy's default)",
    "p50": "median of the finite entries, linear interpolation",
    "p75": "75th percentile of the finite entries, linear interpolation",
    "zero_fraction": "entries exactly equal to zero divided by the element count",
    "nonfinite_fraction": "NaN, +Inf and -Inf entries divided by the element count",
}
"""One-line definition of each default metric, for docs and index.md."""
