"""The precision profile, declared once: what casting a tensor to a low-precision format loses.

An observer given ``precision=("bfloat16", ...)`` adds, for every measured tensor, the metric
``min_abs_nonzero`` and, for each listed format ``F``, the metrics ``<metric>.<F>`` of
:data:`PRECISION_METRICS` (``underflow_fraction.bfloat16``, ...). Their names and definitions
are part of the contract (since 1.3): :func:`precision_profile` is the declaration a run's
producer and readers use, :func:`metric_name_problem` the name rule the validators apply
(``<metric>.<format>`` only for the metrics and formats declared here). docs/metrics.md,
"Precision", defines each one with its oracle (torch's own cast, ``tensor.to(F)``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal, get_args

from ti_schema.metrics import DEFAULT_PROFILE, MetricProfile, MetricSpec
from ti_schema.stability import STABILITY_SPECS

PrecisionFormat = Literal["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "mxfp8_e4m3"]
"""A low-precision format, named as the torch dtype it casts to; ``mxfp8_e4m3`` is the OCP
Microscaling (MX) v1.0 block-scaled format with ``float8_e4m3fn`` elements."""

PRECISION_FORMATS: Final[tuple[PrecisionFormat, ...]] = get_args(PrecisionFormat)
"""Every declared format, in the order docs list them."""

MX_FORMATS: Final[dict[str, str]] = {"mxfp8_e4m3": "float8_e4m3fn"}
"""Block-scaled formats and the element dtype their scaled entries are cast to."""

MX_BLOCK: Final[int] = 32
"""Elements per MX block, consecutive along the last dimension."""

PRECISION_METRICS: Final[tuple[str, ...]] = (
    "underflow_fraction",
    "subnormal_fraction",
    "overflow_fraction",
)
"""The per-format metrics; each row's metric is ``<metric>.<format>``."""

MIN_ABS_NONZERO: Final[MetricSpec] = MetricSpec(
    "min_abs_nonzero",
    "smallest magnitude of the finite non-zero entries (recorded when a precision format is "
    "listed; amax is the larger magnitude of min and max, dynamic range amax / min_abs_nonzero)",
    "finite",
    combine="min",
    null_reason="no non-zero finite entries",
)

_DEFINITIONS: Final[dict[str, str]] = {
    "underflow_fraction": "finite non-zero entries that become zero when cast to {f} (round to "
    "nearest even, as tensor.to({f})), divided by the element count",
    "subnormal_fraction": "entries whose cast to {f} is a non-zero subnormal of {f}, divided by "
    "the element count",
    "overflow_fraction": "finite entries whose magnitude exceeds {f}'s largest finite value "
    "(torch.finfo({f}).max: they saturate or become infinite when cast), divided by the "
    "element count",
}
_MX_DEFINITIONS: Final[dict[str, str]] = {
    "underflow_fraction": "finite non-zero entries that become zero in {f}: blocks of 32 along "
    "the last dimension, scale 2^(floor(log2(block amax)) - 8), entry / scale cast to "
    "float8_e4m3fn; divided by the element count",
    "subnormal_fraction": "entries whose scaled value (as for underflow) casts to a non-zero "
    "subnormal of float8_e4m3fn, divided by the element count",
    "overflow_fraction": "finite entries whose scaled value exceeds 448 (float8_e4m3fn's "
    "largest finite value) and saturates: 0 except where a block amax's significand exceeds "
    "1.75 or the scale is clamped to 2^127; divided by the element count",
}


def precision_metric(metric: str, fmt: str) -> str:
    """The ``metric`` column value of ``metric`` for ``fmt``: ``"underflow_fraction.float16"``."""
    return f"{metric}.{fmt}"


def check_formats(formats: Iterable[str], argument: str = "precision") -> tuple[str, ...]:
    """``formats`` as a tuple of declared formats (duplicates dropped, order kept); a
    ValueError naming ``argument`` and the valid formats otherwise."""
    if isinstance(formats, str | bytes):
        raise TypeError(
            f"{argument}= must be a collection of format names, e.g. ('bfloat16', "
            f"'float8_e4m3fn'), got the string {formats!r}"
        )
    try:
        names = list(formats)
    except TypeError:
        raise TypeError(
            f"{argument}= must be a collection of format names from {list(PRECISION_FORMATS)}, "
            f"got {formats!r}"
        ) from None
    unknown = [f for f in names if f not in PRECISION_FORMATS]
    if unknown:
        raise ValueError(
            f"{argument}= names unknown format(s) {unknown!r}; choose from "
            f"{list(PRECISION_FORMATS)}"
        )
    return tuple(dict.fromkeys(names))


def format_specs(fmt: str) -> tuple[MetricSpec, ...]:
    """The declared metrics of one format, in :data:`PRECISION_METRICS` order."""
    (fmt,) = check_formats([fmt])
    texts = _MX_DEFINITIONS if fmt in MX_FORMATS else _DEFINITIONS
    return tuple(
        MetricSpec(
            precision_metric(metric, fmt),
            texts[metric].format(f=fmt),
            "all",
            fraction=True,
            combine="entry_mean",
        )
        for metric in PRECISION_METRICS
    )


def precision_specs(formats: Iterable[str]) -> tuple[MetricSpec, ...]:
    """``min_abs_nonzero`` then every format's metrics (none when ``formats`` is empty)."""
    chosen = check_formats(formats)
    if not chosen:
        return ()
    return (MIN_ABS_NONZERO, *(spec for fmt in chosen for spec in format_specs(fmt)))


def precision_profile(
    formats: Iterable[str], base: MetricProfile = DEFAULT_PROFILE
) -> MetricProfile:
    """``base`` with the precision metrics of ``formats`` appended (``base`` itself when
    ``formats`` is empty)."""
    specs = precision_specs(formats)
    return base.extended(specs) if specs else base


FULL_PRECISION_PROFILE: Final[MetricProfile] = precision_profile(PRECISION_FORMATS)
"""The default profile and every declared precision metric: every metric the contract
defines."""


DECLARED_PROFILE: Final[MetricProfile] = FULL_PRECISION_PROFILE.extended(STABILITY_SPECS)
"""Every metric the contract declares: the default profile, the precision metrics and the
stability metrics (:mod:`ti_schema.stability`)."""


def declared_metric(name: str) -> MetricSpec | None:
    """The contract's declaration of the metric ``name`` (default, precision or stability),
    or None for a custom metric."""
    return DECLARED_PROFILE.get(name) if name in DECLARED_PROFILE else None


def metric_name_problem(name: str) -> str | None:
    """Why ``name`` may not be a metric name, or None. ``<metric>.<format>`` is reserved: it
    is accepted only for a declared precision metric and a declared format."""
    head, dot, tail = name.rpartition(".")
    if not dot:
        return None
    if head in PRECISION_METRICS and tail not in PRECISION_FORMATS:
        return (
            f"{name!r} names the precision metric {head!r} for the unknown format {tail!r}; "
            f"the formats are {list(PRECISION_FORMATS)}"
        )
    if tail in PRECISION_FORMATS and head not in PRECISION_METRICS:
        return (
            f"{name!r} names the format {tail!r} for {head!r}, which is not a precision "
            f"metric; they are {list(PRECISION_METRICS)}"
        )
    return None


def profile_of(names: Iterable[str], base: MetricProfile = DEFAULT_PROFILE) -> MetricProfile:
    """``base`` and the declared precision and stability metrics among ``names`` (in
    declaration order): the declaration that applies to a run that recorded ``names``."""
    present = set(names)
    extra = [m for m in DECLARED_PROFILE if m.name in present and m.name not in base]
    return base.extended(extra) if extra else base


__all__ = [
    "DECLARED_PROFILE",
    "FULL_PRECISION_PROFILE",
    "MIN_ABS_NONZERO",
    "MX_BLOCK",
    "MX_FORMATS",
    "PRECISION_FORMATS",
    "PRECISION_METRICS",
    "PrecisionFormat",
    "check_formats",
    "declared_metric",
    "format_specs",
    "metric_name_problem",
    "precision_metric",
    "precision_profile",
    "precision_specs",
    "profile_of",
]
