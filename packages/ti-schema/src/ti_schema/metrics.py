"""The default metric profile, declared once: what each metric is and how readers treat it.

Every producer and reader derives what it needs from :data:`DEFAULT_PROFILE`: ti-core its
column layout and which metrics need finite entries, ti-io the order and definitions it prints,
ti-dist how the shards of one tensor combine, the validators which values must lie in
``[0, 1]``. A new default metric is one :class:`MetricSpec` here plus one function per
reduction engine in ti-core (docs/architecture.md, "Where to change what").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Final, Literal

Over = Literal["finite", "all"]
"""What a metric is computed over: the finite entries (unavailable when a tensor has none), or
every entry (the denominator of a fraction is the element count; available for any non-empty
tensor)."""

Combine = Literal["finite_mean", "pooled_std", "min", "max", "entry_mean", "root_mean_square"]
"""How the shards of one tensor (one per rank) combine exactly into the whole tensor's value:

- ``finite_mean``: mean of the shards' values weighted by their finite entries (a mean over
  the finite entries);
- ``pooled_std``: the population std of the union, from each shard's std, its
  ``finite_mean`` metric (:attr:`MetricSpec.pooled_with`) and its finite entries;
- ``min`` / ``max``: the smallest / largest of the shards' values;
- ``entry_mean``: mean weighted by the shards' element counts (a fraction of all entries);
- ``root_mean_square``: ``sqrt`` of the mean of the shards' squared values weighted by their
  finite entries (a root mean square over the finite entries; contract 1.5).
"""

COMBINE_RULES: Final[tuple[Combine, ...]] = (
    "finite_mean",
    "pooled_std",
    "min",
    "max",
    "entry_mean",
    "root_mean_square",
)


@dataclass(frozen=True)
class MetricSpec:
    """One metric of the profile: what readers need to know about its values."""

    name: str
    """The value of the ``metric`` column."""
    definition: str
    """One line, for docs and index.md."""
    over: Over
    fraction: bool = False
    """Its values lie in ``[0, 1]`` (the validators check it)."""
    combine: Combine | None = None
    """How shards combine exactly; None: they do not, and :attr:`not_combinable` says why."""
    not_combinable: str = ""
    pooled_with: str = ""
    """For ``combine="pooled_std"``: the ``finite_mean`` metric it is pooled around."""
    null_reason: str = ""
    """Why a value may be null although the tensor has the entries ``over`` names (e.g.
    ``min_abs_nonzero`` of a tensor whose finite entries are all zero); the producer writes it
    as the ``unavailable_reason``, and a combination skips such shards (``min`` / ``max``)."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"MetricSpec(name=...) must be a non-empty string, got {self.name!r}")
        if self.over not in ("finite", "all"):
            raise ValueError(f"MetricSpec {self.name!r}: over must be 'finite' or 'all'")
        if self.combine is None and not self.not_combinable:
            raise ValueError(
                f"MetricSpec {self.name!r} does not combine across shards: say why in "
                "not_combinable"
            )
        if self.combine is not None and self.combine not in COMBINE_RULES:
            raise ValueError(
                f"MetricSpec {self.name!r}: combine must be one of {COMBINE_RULES} or None, "
                f"got {self.combine!r}"
            )
        if (self.combine == "pooled_std") != bool(self.pooled_with):
            raise ValueError(
                f"MetricSpec {self.name!r}: pooled_with names the mean a 'pooled_std' metric "
                "is pooled around, and only such a metric has one"
            )


@dataclass(frozen=True)
class MetricProfile:
    """An ordered set of metrics: the order producers emit them and readers list them."""

    metrics: tuple[MetricSpec, ...]

    def __post_init__(self) -> None:
        names = [m.name for m in self.metrics]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"a metric profile names {dupes} more than once")
        for m in self.metrics:
            if m.pooled_with and self.get(m.pooled_with).combine != "finite_mean":
                raise ValueError(
                    f"metric {m.name!r} is pooled with {m.pooled_with!r}, which must be a "
                    "'finite_mean' metric of the same profile"
                )

    def __iter__(self) -> Iterator[MetricSpec]:
        return iter(self.metrics)

    def __len__(self) -> int:
        return len(self.metrics)

    def __contains__(self, name: object) -> bool:
        return any(m.name == name for m in self.metrics)

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.metrics)

    def get(self, name: str) -> MetricSpec:
        """The metric named ``name``; KeyError naming the profile's metrics otherwise."""
        for m in self.metrics:
            if m.name == name:
                return m
        raise KeyError(f"no metric {name!r} in the profile; it has {list(self.names)}")

    def over(self, over: Over) -> tuple[str, ...]:
        """Names of the metrics computed over ``over`` entries, in profile order."""
        return tuple(m.name for m in self.metrics if m.over == over)

    @property
    def fractions(self) -> tuple[str, ...]:
        """Names of the metrics whose values lie in ``[0, 1]``."""
        return tuple(m.name for m in self.metrics if m.fraction)

    @property
    def definitions(self) -> dict[str, str]:
        return {m.name: m.definition for m in self.metrics}

    def extended(self, metrics: Iterable[MetricSpec]) -> MetricProfile:
        """This profile with ``metrics`` appended (a copy; this one is unchanged)."""
        return MetricProfile((*self.metrics, *metrics))


_QUARTILES_DO_NOT_COMBINE: Final = (
    "the quartiles of a sharded tensor do not follow from its shards' quartiles"
)

DEFAULT_PROFILE: Final[MetricProfile] = MetricProfile(
    (
        MetricSpec(
            "mean", "arithmetic mean of the finite entries", "finite", combine="finite_mean"
        ),
        MetricSpec(
            "std",
            "population standard deviation (ddof=0) of the finite entries",
            "finite",
            combine="pooled_std",
            pooled_with="mean",
        ),
        MetricSpec("min", "smallest finite entry", "finite", combine="min"),
        MetricSpec("max", "largest finite entry", "finite", combine="max"),
        MetricSpec(
            "p25",
            "25th percentile of the finite entries, linear interpolation (numpy's default)",
            "finite",
            not_combinable=_QUARTILES_DO_NOT_COMBINE,
        ),
        MetricSpec(
            "p50",
            "median of the finite entries, linear interpolation",
            "finite",
            not_combinable=_QUARTILES_DO_NOT_COMBINE,
        ),
        MetricSpec(
            "p75",
            "75th percentile of the finite entries, linear interpolation",
            "finite",
            not_combinable=_QUARTILES_DO_NOT_COMBINE,
        ),
        MetricSpec(
            "zero_fraction",
            "entries exactly equal to zero divided by the element count",
            "all",
            fraction=True,
            combine="entry_mean",
        ),
        MetricSpec(
            "nonfinite_fraction",
            "NaN, +Inf and -Inf entries divided by the element count",
            "all",
            fraction=True,
            combine="entry_mean",
        ),
    )
)
"""The default metric profile, in the order producers emit it (docs/metrics.md)."""

DEFAULT_METRICS: Final[tuple[str, ...]] = DEFAULT_PROFILE.names
"""The default metric profile's names, in the order producers emit them."""

FINITE_METRICS: Final[tuple[str, ...]] = DEFAULT_PROFILE.over("finite")
"""Metrics computed over the finite entries of a tensor (std is the population std)."""

FRACTION_METRICS: Final[tuple[str, ...]] = DEFAULT_PROFILE.over("all")
"""Metrics computed over all entries; the denominator is the original element count."""

METRIC_DEFINITIONS: Final[dict[str, str]] = DEFAULT_PROFILE.definitions
"""One-line definition of each default metric, for docs and index.md."""

__all__ = [
    "COMBINE_RULES",
    "DEFAULT_METRICS",
    "DEFAULT_PROFILE",
    "FINITE_METRICS",
    "FRACTION_METRICS",
    "METRIC_DEFINITIONS",
    "Combine",
    "MetricProfile",
    "MetricSpec",
    "Over",
]
