"""torchinstruments 0.8.0 reducers (``reducer(tensor) -> {metric_name: value}``) adapted into
today's ``Reducer`` specs, one per metric name learned from probe tensors."""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from ti_core.legacy.call_site import user_stacklevel
from ti_core.reducers import DefaultProfile, Reducer


def _label(obj: object) -> str:
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return str(name)


def is_legacy_reducer(item: object) -> bool:
    """A 0.8.0 reducer: any callable that is not one of today's reducer specs."""
    return callable(item) and not isinstance(item, type | DefaultProfile | Reducer)


PROBE_SHAPES: Final[tuple[tuple[int, ...], ...]] = (
    (4, 4),
    (2, 16),
    (2, 3, 8, 8),
    (2, 8, 16),
    (64,),
)
"""The float32 tensors a 0.8.0 reducer is called on at ``inject_observer`` to learn its metric
names, in order until one call succeeds: a matrix, then the shapes of typical outputs
(features, convolution maps, sequences, a vector), for reducers that need a given rank."""


@dataclass(frozen=True)
class LearnedNames:
    """What the probes taught about a 0.8.0 reducer: its metric names, or why none could be
    learned (every probe call raised)."""

    names: tuple[str, ...]
    failure: str | None = None
    """``"RuntimeError: ..."`` of the first probe when every probe raised; the reducer is then
    one metric named after it, whose values are its errors until it is fixed."""


def _probe(reducer: Callable[[torch.Tensor], Any], where: str) -> LearnedNames:
    """The metric names ``reducer`` returns for the first probe tensor it accepts.

    A reducer that raises on every probe may still work on the model's real tensors, so that
    does not refuse it (its failures then go through ``error_policy`` at the forward); a result
    that is not a dict of names is a reducer of another form, refused with the fix.
    """
    failure: str | None = None
    for shape in PROBE_SHAPES:
        probe = torch.linspace(-1.0, 1.0, math.prod(shape)).reshape(shape)
        try:
            with torch.no_grad():
                result = reducer(probe)
        except Exception as exc:
            failure = failure or f"{type(exc).__name__}: {exc}"
            continue
        if not isinstance(result, Mapping) or not result:
            raise TypeError(
                f"{where}: {reducer!r} returned {type(result).__name__}, not a dict of metric "
                "names as a torchinstruments 0.8.0 reducer does; for one metric pass "
                "Reducer('name', fn) (from ti_core import Reducer)"
            )
        bad = [key for key in result if not isinstance(key, str) or not key]
        if bad:
            raise TypeError(
                f"{where}: {reducer!r} returned metric names {bad!r}; use non-empty strings"
            )
        return LearnedNames(tuple(result))
    return LearnedNames((_metric_label(reducer),), failure)


def _metric_label(reducer: Callable[[torch.Tensor], Any]) -> str:
    """The metric name of a reducer whose names could not be learned: its own name."""
    name = getattr(reducer, "__name__", None) or type(reducer).__name__
    return str(name) if name and name != "<lambda>" else "legacy_reducer"


_MISSING: Final = object()


class _SharedResult:
    """Runs one 0.8.0 reducer once per tensor and hands each of its metrics to the ``Reducer``
    that reports it (the reduction plan asks metric by metric)."""

    def __init__(self, reducer: Callable[[torch.Tensor], Any], learned: LearnedNames) -> None:
        self.reducer = reducer
        self.names = learned.names
        self.probe_failure = learned.failure
        self._lock = threading.Lock()
        # id(tensor) -> (weak ref to it, the result or the exception, metrics still to hand out)
        self._pending: dict[int, tuple[weakref.ref[torch.Tensor], Any, int]] = {}

    def value(self, tensor: torch.Tensor, name: str) -> Any:
        key = id(tensor)
        outcome: Any = _MISSING
        with self._lock:
            entry = self._pending.get(key)
            if entry is not None and entry[0]() is tensor:
                ref, outcome, left = entry
                if left <= 1:
                    del self._pending[key]
                else:
                    self._pending[key] = (ref, outcome, left - 1)
        if outcome is _MISSING:
            try:
                outcome = self.reducer(tensor)
            except Exception as exc:
                outcome = exc
            if len(self.names) > 1:
                pending = self._pending

                def forget(_: object, key: int = key) -> None:
                    pending.pop(key, None)

                with self._lock:
                    self._pending[key] = (weakref.ref(tensor, forget), outcome, len(self.names) - 1)
        if isinstance(outcome, Exception):
            raise outcome
        return self._pick(outcome, name)

    def _pick(self, result: Any, name: str) -> Any:
        if self.probe_failure is not None and isinstance(result, Mapping):
            raise ValueError(
                f"the torchinstruments 0.8.0 reducer {_label(self.reducer)} returned metrics "
                f"{sorted(str(k) for k in result)}, but it raised on every probe tensor at "
                f"inject_observer ({self.probe_failure}), so its metric names are not in this "
                "run; make it accept a small float32 tensor, or write one Reducer(name, fn) per "
                "metric (from ti_core import Reducer)"
            )
        if not isinstance(result, Mapping):
            raise TypeError(
                f"the torchinstruments 0.8.0 reducer {_label(self.reducer)} returned "
                f"{type(result).__name__}, not a dict of metric names"
            )
        if name == self.names[0]:
            extra = sorted(str(k) for k in result if k not in self.names)
            if extra:
                raise ValueError(
                    f"the torchinstruments 0.8.0 reducer {_label(self.reducer)} returned metrics "
                    f"{extra} that it did not return at inject_observer (the metric names are "
                    f"learned then: {list(self.names)}); return the same names for every tensor"
                )
        if name not in result:
            raise LookupError(
                f"the torchinstruments 0.8.0 reducer {_label(self.reducer)} returned no "
                f"{name!r} for this tensor"
            )
        return result[name]


@dataclass(frozen=True)
class _LegacyMetric:
    """``Reducer.fn`` for one metric of a 0.8.0 reducer."""

    shared: _SharedResult
    name: str

    def __call__(self, tensor: torch.Tensor) -> Any:
        return self.shared.value(tensor, self.name)


@dataclass(frozen=True)
class AdaptedReducers:
    """``reducers=`` as today's specs, and a note per 0.8.0 reducer whose names the probes could
    not learn (``RunInfo.settings`` entries, shown in index.md)."""

    reducers: Any
    notes: dict[str, str] = field(default_factory=dict)


def adapt_reducers(reducers: Any) -> AdaptedReducers:
    """``reducers=`` with every 0.8.0 reducer replaced by one ``Reducer`` per metric it returns
    (one FutureWarning each); anything else is returned unchanged for the usual checks."""
    if not isinstance(reducers, Sequence) or isinstance(reducers, str | bytes):
        return AdaptedReducers(reducers)
    if not any(is_legacy_reducer(item) for item in reducers):
        return AdaptedReducers(reducers)
    adapted: list[Any] = []
    notes: dict[str, str] = {}
    for i, item in enumerate(reducers):
        if not is_legacy_reducer(item):
            adapted.append(item)
            continue
        learned = _probe(item, f"reducers[{i}]")
        names = learned.names
        shared = _SharedResult(item, learned)
        adapted += [Reducer(name, _LegacyMetric(shared, name)) for name in names]
        if learned.failure is not None:
            notes[f"reducers[{i}]"] = (
                f"torchinstruments 0.8.0 reducer {_label(item)} raised on every probe tensor "
                f"at inject_observer ({learned.failure}); recorded as metric {names[0]!r}, "
                "its failures at the forward handled by error_policy"
            )
        warnings.warn(
            f"reducers[{i}] ({_label(item)}) is a torchinstruments 0.8.0 reducer returning "
            f"{{name: value}} for the metrics {list(names)}; it is adapted, but write one "
            f"Reducer per metric instead: Reducer({names[0]!r}, fn) from ti_core, with fn "
            "returning one number",
            FutureWarning,
            stacklevel=user_stacklevel(),
        )
    return AdaptedReducers(adapted, notes)


__all__ = [
    "PROBE_SHAPES",
    "AdaptedReducers",
    "LearnedNames",
    "adapt_reducers",
    "is_legacy_reducer",
]
