"""``inject_observer``'s options as one frozen, checked object.

:class:`Options` is the one declaration of the options: their names, types and defaults, the
check of each (a clear error naming the argument, before the model is touched), and what the
run records of them in run.json's settings (:meth:`Options.run_settings`). ``inject_observer``
builds one from its keyword arguments; the trainer callbacks take the same names
(:data:`OPTION_NAMES`) and build one when their trainer starts. :class:`ObserverOptions` is the
same list as a ``TypedDict``, for typing ``**options`` (``Unpack``); the two are checked equal
at import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from os import PathLike
from typing import Final, TypedDict

from ti_core.capture.updates import DEFAULT_UPDATE_BUDGET_BYTES
from ti_core.errors import ErrorPolicy, ErrorPolicyName
from ti_core.ranks import RankPolicy
from ti_core.reduction.plan import ReducerSpec
from ti_core.sampling import DEFAULT_INTERVAL, Sampler, interval_seconds
from ti_core.selection import Selector
from ti_core.sentinel import Sentinel, resolve_sentinel
from ti_core.sink import Sink
from ti_schema import DEFAULT_METRICS, DEFAULT_SIGNALS, SIGNALS, Signal
from ti_schema.precision import check_formats


class _DefaultOutputDir(str):
    """The default ``output_dir``: equal to ``"stats"``, told apart from an explicit
    ``output_dir="stats"`` by identity (a DirectorySink in ``sink=`` replaces only the default)."""

    __slots__ = ()


DEFAULT_OUTPUT_DIR: Final[str] = _DefaultOutputDir("stats")


@dataclass(frozen=True, kw_only=True)
class Options:
    """The options of :func:`~ti_core.inject_observer` (its docstring says what each does),
    checked when made: ``TypeError`` / ``ValueError`` naming the argument."""

    output_dir: str | PathLike[str] | None = DEFAULT_OUTPUT_DIR
    sink: Sink | Sequence[Sink] | None = None
    sampler: Sampler | None = None
    interval: timedelta | float = DEFAULT_INTERVAL
    selector: Selector | None = None
    reducers: Sequence[ReducerSpec] | None = None
    histogram_selector: Selector | Collection[str] | None = None
    max_histogram_modules: int = 8
    rank_policy: str | RankPolicy = "rank0"
    error_policy: ErrorPolicyName = "warn"
    capture_direct_forwards: bool = False
    signals: Collection[Signal] = DEFAULT_SIGNALS
    update_budget_bytes: int = DEFAULT_UPDATE_BUDGET_BYTES
    handle_sigterm: bool = True
    precision: Collection[str] = ()
    sentinel: bool | Sentinel = True
    settings: Mapping[str, str] | None = None
    metrics: Collection[str] = DEFAULT_METRICS

    # Resolved by the checks (not options; immutable): what the observer is built from.
    chosen_signals: tuple[Signal, ...] = field(init=False, repr=False, compare=False)
    chosen_sentinel: Sentinel | None = field(init=False, repr=False, compare=False)
    extra_settings: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.error_policy, str):
            raise TypeError(
                f"error_policy= must be 'warn', 'ignore' or 'raise', got {self.error_policy!r}"
            )
        ErrorPolicy(self.error_policy)  # ValueError naming an unknown policy
        if not isinstance(self.capture_direct_forwards, bool):
            raise TypeError(
                f"capture_direct_forwards= must be a bool, got {self.capture_direct_forwards!r}"
            )
        if not isinstance(self.handle_sigterm, bool):
            raise TypeError(
                f"handle_sigterm= must be True or False, got {self.handle_sigterm!r} (False "
                "leaves SIGTERM to a program that manages its signals itself)"
            )
        resolved = {
            "extra_settings": _resolve_settings(self.settings),
            "chosen_signals": _resolve_signals(self.signals),
            "chosen_sentinel": resolve_sentinel(self.sentinel),
        }
        for name, value in resolved.items():
            object.__setattr__(self, name, value)  # frozen: set once, here
        _check_count(
            self.update_budget_bytes,
            "update_budget_bytes",
            "an int >= 0 (bytes)",
            "0 measures no update",
        )
        _check_count(
            self.max_histogram_modules,
            "max_histogram_modules",
            "an int >= 0",
            "0 turns histograms off",
        )
        if self.sampler is None:
            interval_seconds(self.interval)

    @classmethod
    def of(cls, options: Mapping[str, object], caller: str) -> Options:
        """``Options(**options)``, an unknown name refused as ``caller``'s."""
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(
                f"{caller}() got unexpected keyword argument(s) {', '.join(unknown)}; its "
                f"options are {', '.join(OPTION_NAMES)}"
            )
        return cls(**options)  # type: ignore[arg-type]

    def run_settings(
        self, *, notes: Mapping[str, str], alignment: Mapping[str, str]
    ) -> dict[str, str]:
        """What run.json (and index.md) record of these options: ti-core's settings, the
        reducers' adaptation ``notes`` and the ranks' ``alignment``, then the caller's own
        (``settings=``; ``ValueError`` for a key ti-core records itself)."""
        recorded = {
            "error_policy": self.error_policy,
            "capture_direct_forwards": str(self.capture_direct_forwards).lower(),
            "max_histogram_modules": str(self.max_histogram_modules),
            "selector": repr(self.selector) if self.selector is not None else "leaf_modules()",
            "rank_policy": repr(self.rank_policy),
            "signals": ",".join(self.chosen_signals),
            **({"sentinel": repr(self.chosen_sentinel)} if self.chosen_sentinel else {}),
            **notes,
            **alignment,
            **({"precision": ",".join(check_formats(self.precision))} if self.precision else {}),
            **(
                {"update_budget_bytes": str(self.update_budget_bytes)}
                if "parameter_update" in self.chosen_signals
                else {}
            ),
        }
        taken = sorted(set(recorded) & set(self.extra_settings))
        if taken:
            raise ValueError(
                f"settings= may not set {taken}: ti-core records them itself; choose other keys"
            )
        return {**recorded, **self.extra_settings}


OPTION_NAMES: Final[tuple[str, ...]] = tuple(f.name for f in dataclasses.fields(Options) if f.init)
"""The keyword arguments of ``inject_observer`` (and so of every trainer callback)."""


class ObserverOptions(TypedDict, total=False):
    """:class:`Options` as keyword arguments (``**options: Unpack[ObserverOptions]``)."""

    output_dir: str | PathLike[str] | None
    sink: Sink | Sequence[Sink] | None
    sampler: Sampler | None
    interval: timedelta | float
    selector: Selector | None
    reducers: Sequence[ReducerSpec] | None
    histogram_selector: Selector | Collection[str] | None
    max_histogram_modules: int
    rank_policy: str | RankPolicy
    error_policy: ErrorPolicyName
    capture_direct_forwards: bool
    signals: Collection[Signal]
    update_budget_bytes: int
    handle_sigterm: bool
    precision: Collection[str]
    sentinel: bool | Sentinel
    settings: Mapping[str, str] | None
    metrics: Collection[str]


if tuple(ObserverOptions.__annotations__) != OPTION_NAMES:  # pragma: no cover - a declaration bug
    raise AssertionError("ObserverOptions and Options must list the same options, in order")


def _check_count(value: object, name: str, what: str, zero: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}= must be {what}, got {value!r}")
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0 ({zero})")


def _resolve_settings(settings: Mapping[str, str] | None) -> dict[str, str]:
    """The caller's run settings (``inject_observer(settings=...)``), checked."""
    if settings is None:
        return {}
    if not isinstance(settings, Mapping) or not all(
        isinstance(k, str) and k and isinstance(v, str) for k, v in settings.items()
    ):
        raise TypeError(
            "settings= must map non-empty strings to strings (str(value) what is not one), "
            f"got {settings!r}"
        )
    return dict(settings)


def _resolve_signals(signals: Collection[Signal]) -> tuple[Signal, ...]:
    """The signals to record, in contract order; a clear error for anything else."""
    if isinstance(signals, str | bytes) or not isinstance(signals, Collection):
        raise TypeError(
            f"signals= must be a collection of signal names, e.g. ('output', 'output_gradient', "
            f"'parameter_update'), got {signals!r}"
        )
    names = list(signals)
    unknown = [n for n in names if n not in SIGNALS]
    if unknown:
        raise ValueError(
            f"signals= names unknown signal(s) {unknown!r}; choose from {list(SIGNALS)}"
        )
    if not names:
        raise ValueError(
            "signals= is empty, so nothing would be recorded; pass e.g. "
            f"signals={DEFAULT_SIGNALS!r} (the default)"
        )
    return tuple(s for s in SIGNALS if s in names)


__all__ = ["DEFAULT_OUTPUT_DIR", "OPTION_NAMES", "ObserverOptions", "Options"]
