"""torchinstruments 0.8.0 reducers and sinks, accepted unchanged and adapted at the boundary.

The single-package predecessor documented two extension points, and code written for them keeps
working here, with one ``FutureWarning`` per adapted object naming today's form:

- a **reducer** is a callable ``reducer(tensor) -> {metric_name: value}`` (values: numbers,
  bools or one-element tensors; several metrics per call). Today a custom metric is
  ``Reducer(name, fn)`` with ``fn(tensor)`` returning one number. :func:`adapt_reducers` learns
  the metric names by calling the old reducer on small probe tensors at ``inject_observer``
  (:data:`PROBE_SHAPES`, until one call succeeds) and turns it into one ``Reducer`` per name
  (the reducer still runs once per measured tensor; its result is shared by those ``Reducer``
  objects). One that raises on every probe is still attached, as one metric named after it:
  its errors at the forward go through ``error_policy`` like any reducer's.
- a **sink** has ``initialize(run, modules)``, ``observe(sample)`` and ``close()`` and receives
  the 0.8.0 records (``RunRecord``, ``ModuleRecord``, ``SampleRecord`` ...). Today a sink
  implements :class:`ti_core.Sink` and receives Arrow record batches. :class:`LegacySink`
  rebuilds the 0.8.0 records from those batches: one ``SampleRecord`` per sampled forward
  (``SampleState.FORWARD_COMPLETE``, the outputs) and one per observed backward
  (``BACKWARD_OBSERVED``, the output gradients, with that forward's outputs), tensor paths
  spelled as 0.8.0 did (``output``, ``output.0``, ``grad_output.aux.0``), histograms named
  ``distribution``. The record classes are torchinstruments' own when it is installed (so
  ``sample.state is SampleState.FORWARD_COMPLETE`` holds), else the look-alikes below.

What 0.8.0 records held that ti-core does not produce: ``TensorRecord.device`` is
``"unknown"``, ``SampleRecord.collection_duration_ms`` is 0.0 and ``errors`` is empty (failures
go through the error policy instead); rows that only record a gradient coverage gap (a leaf
output, reentrant checkpointing), which 0.8.0 did not have, are not passed on.
"""

from __future__ import annotations

import ast
import importlib
import math
import re
import sys
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import pyarrow as pa
import torch
from torch import nn

from ti_core.reducers import DefaultProfile, Reducer
from ti_core.sink import RunInfo, Sink, SinkCapabilities

LEGACY_SCHEMA_VERSION: Final[int] = 6
"""``torchinstruments.records.SCHEMA_VERSION`` of 0.8.0, the record layout rebuilt here."""
HISTOGRAM_NAME: Final[str] = "distribution"
"""Name of 0.8.0's default histogram, under which histograms reach a 0.8.0 sink."""
FORWARD_MEMORY: Final[int] = 64
"""Sampled forwards whose outputs are kept for the record of their backward (0.8.0's backward
record also carries the outputs); an older forward's backward record has no outputs."""

_PACKAGE_DIR: Final[str] = str(Path(__file__).resolve().parent)


# ----------------------------------------------------------------- 0.8.0 records (look-alikes)


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


# ----------------------------------------------------------------------------------- helpers


def _user_stacklevel() -> int:
    """``stacklevel`` of the first frame outside ti-core and contextlib: a warning points at
    the user's ``inject_observer`` (or ``observe``) call."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_PACKAGE_DIR) or name.endswith("contextlib.py")):
            return level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def _label(obj: object) -> str:
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return str(name)


# ---------------------------------------------------------------------------------- reducers


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
            stacklevel=_user_stacklevel(),
        )
    return AdaptedReducers(adapted, notes)


# ------------------------------------------------------------------------------------- sinks


def is_legacy_sink(item: object) -> bool:
    """A 0.8.0 sink: ``initialize``/``observe``/``close`` and not today's Sink protocol."""
    return (
        not isinstance(item, type)
        and not isinstance(item, Sink)
        and all(callable(getattr(item, m, None)) for m in ("initialize", "observe", "close"))
    )


def adapt_sinks(sink: Any, modules: Sequence[nn.Module]) -> Any:
    """``sink=`` with every 0.8.0 sink wrapped in a :class:`LegacySink` (one FutureWarning
    each). ``modules`` are the selected modules, in the order of ``RunInfo.layers``: 0.8.0's
    module records carry their parameter counts."""
    if sink is None:
        return None
    single = is_legacy_sink(sink)
    items = [sink] if single else sink
    if not single and (not isinstance(sink, Sequence) or isinstance(sink, str | bytes)):
        return sink
    if not any(is_legacy_sink(item) for item in items):
        return sink
    counts = [_parameter_counts(module) for module in modules]
    adapted = []
    for i, item in enumerate(items):
        if not is_legacy_sink(item):
            adapted.append(item)
            continue
        adapted.append(LegacySink(item, counts))
        where = "sink=" if single else f"sink[{i}]"
        warnings.warn(
            f"{where} {type(item).__qualname__} is a torchinstruments 0.8.0 sink "
            "(initialize/observe/close); it is adapted, but implement ti_core.Sink instead: "
            "open(run), write_history(batch), write_histograms(batch), close()",
            FutureWarning,
            stacklevel=_user_stacklevel(),
        )
    return adapted[0] if single else adapted


def _parameter_counts(module: nn.Module) -> tuple[int, int]:
    own = list(module.parameters(recurse=False))
    return (
        sum(p.numel() for p in own),
        sum(p.numel() for p in own if p.requires_grad),
    )


def legacy_path(tensor_path: str, *, gradient: bool) -> str:
    """Today's ``tensor_path`` in 0.8.0's spelling: ``''`` -> ``output``, ``[0]`` ->
    ``output.0``, ``['aux'][0]`` -> ``output.aux.0``, ``.field`` -> ``output.field``; gradients
    start with ``grad_output``."""
    prefix = "grad_output" if gradient else "output"
    segments: list[str] = []
    i = 0
    try:
        while i < len(tensor_path):
            if tensor_path[i] == ".":
                match = re.match(r"\.([^.\[]+)", tensor_path[i:])
                if match is None:
                    raise ValueError(tensor_path)
                segments.append(match.group(1))
                i += match.end()
            elif tensor_path[i] == "[":
                end = _closing_bracket(tensor_path, i)
                key = tensor_path[i + 1 : end]
                if key[:1] in ("'", '"'):
                    key = str(ast.literal_eval(key))
                segments.append(key)
                i = end + 1
            else:
                raise ValueError(tensor_path)
    except (ValueError, SyntaxError):
        return f"{prefix}.{tensor_path}"
    return ".".join([prefix, *segments])


def _closing_bracket(text: str, start: int) -> int:
    """Index of the ``]`` that closes the ``[`` at ``start`` (quoted keys may hold ``]``)."""
    i = start + 1
    quote = text[i] if i < len(text) and text[i] in "'\"" else None
    if quote is None:
        end = text.index("]", i)
        return end
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == quote:
            if i + 1 < len(text) and text[i + 1] == "]":
                return i + 1
            raise ValueError(text)
        i += 1
    raise ValueError(text)


_SAMPLERS: Final[tuple[tuple[re.Pattern[str], str, str | None], ...]] = (
    (re.compile(r"AlwaysSampler\(\)"), "always", None),
    (re.compile(r"EveryNForwardsSampler\(n=(\d+)\)"), "every_n_forwards", "n"),
    (re.compile(r"TimedSampler\(interval=([0-9.e+-]+)s\)"), "timed", "interval_seconds"),
)


def _sampling(description: str, types: ModuleType) -> Any:
    for pattern, kind, setting in _SAMPLERS:
        match = pattern.fullmatch(description)
        if match is not None:
            settings: dict[str, Any] = {}
            if setting == "n":
                settings["n"] = int(match.group(1))
            elif setting is not None:
                settings[setting] = float(match.group(1))
            return types.SamplingRecord(type=kind, settings=settings)
    return types.SamplingRecord(type=description, settings={})


@dataclass
class _Tensor:
    shape: tuple[int, ...]
    dtype: str
    stats: dict[str, float] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    histograms: dict[str, Any] = field(default_factory=dict)
    unavailable_histograms: dict[str, str] = field(default_factory=dict)


@dataclass
class _Event:
    """One lifecycle event being assembled: a sampled forward's outputs, or its gradients."""

    sample_id: int
    signal: str
    forward_index: int
    timestamp: datetime
    tensors: dict[tuple[str, int, str], _Tensor] = field(default_factory=dict)
    focus: bool = False
    """Holds a focus layer's tensors: its histograms follow in the next write_histograms."""


class LegacySink:
    """A :class:`ti_core.Sink` that feeds a torchinstruments 0.8.0 sink its own records.

    The wrapped sink is called on the thread that writes (the training or backward thread; never
    the emission worker), one call at a time. Its ``initialize`` runs at ``open`` and its
    ``close`` at ``close``; a failure in either propagates as from any sink.
    """

    def __init__(self, sink: Any, parameter_counts: Sequence[tuple[int, int]]) -> None:
        self.sink = sink
        self._counts = list(parameter_counts)
        self._types: ModuleType = sys.modules[__name__]
        self._focus: frozenset[str] = frozenset()
        self._order: dict[str, int] = {}
        self._pending: _Event | None = None
        self._last: tuple[int, str] | None = None
        self._forwards: OrderedDict[int, tuple[datetime, dict[tuple[str, int], dict[str, Any]]]]
        self._forwards = OrderedDict()

    def capabilities(self) -> SinkCapabilities:
        """Training-thread writes only: a 0.8.0 sink never promised thread-safe calls."""
        return SinkCapabilities(background_writes=False)

    def open(self, run: RunInfo) -> None:
        types = self._types = record_types()
        self._focus = frozenset(run.focus_layers)
        self._order = {layer.name: i for i, layer in enumerate(run.layers)}
        modules = {}
        for i, layer in enumerate(run.layers):
            params, trainable = self._counts[i] if i < len(self._counts) else (0, 0)
            modules[layer.name] = types.ModuleRecord(
                type=layer.module_type,
                aliases=(layer.name, *layer.aliases),
                parameter_count=params,
                trainable_parameter_count=trainable,
            )
        direct = run.settings.get("capture_direct_forwards") == "true"
        histograms = (
            (types.ReducerRecord(type="histogram", settings={"name": HISTOGRAM_NAME}),)
            if run.focus_layers
            else ()
        )
        record = types.RunRecord(
            schema_version=LEGACY_SCHEMA_VERSION,
            created_at=run.started_at,
            torch_version=str(torch.__version__),
            observer_version=run.producer.rsplit(" ", 1)[-1],
            sampling=_sampling(run.sampler, types),
            collection=types.CollectionRecord(
                invocation_capture="forward_wrappers" if direct else "pytorch_hooks",
                signals=("module_outputs", "module_output_gradients"),
                scalar_reducers=(
                    types.ReducerRecord(
                        type="statistics", settings={"metrics": tuple(run.metrics)}
                    ),
                ),
                histogram_reducers=histograms,
                histogram_modules=tuple(run.focus_layers),
            ),
        )
        self.sink.initialize(record, modules)

    def write_history(self, batch: pa.RecordBatch) -> None:
        for (sample_id, signal), rows in _grouped(batch).items():
            if (
                signal == "output_gradient"
                and self._last == (sample_id, "output")
                and all(r["value"] is None for r in rows)
            ):
                continue  # coverage-gap rows written with the forward: 0.8.0 had none
            event = self._pending
            if event is None or (event.sample_id, event.signal) != (sample_id, signal):
                self._deliver()
                first = rows[0]
                event = _Event(sample_id, signal, first["forward_index"], first["timestamp"])
                self._pending = event
            for r in rows:
                key = (r["layer"], r["call_index"], r["tensor_path"])
                tensor = event.tensors.get(key)
                if tensor is None:
                    tensor = event.tensors[key] = _Tensor(tuple(r["shape"]), r["dtype"])
                    event.focus = event.focus or r["layer"] in self._focus
                if r["value"] is None:
                    tensor.unavailable[r["metric"]] = r["unavailable_reason"] or "unavailable"
                else:
                    tensor.stats[r["metric"]] = float(r["value"])
            self._last = (sample_id, signal)
            if not event.focus:
                self._deliver()

    def write_histograms(self, batch: pa.RecordBatch) -> None:
        for (sample_id, signal), rows in _grouped(batch).items():
            event = self._pending
            if event is None or (event.sample_id, event.signal) != (sample_id, signal):
                continue  # no measured tensor to attach them to
            for r in rows:
                tensor = event.tensors.get((r["layer"], r["call_index"], r["tensor_path"]))
                if tensor is None:
                    continue
                if not r["num"]:
                    tensor.unavailable_histograms[HISTOGRAM_NAME] = "tensor has no finite values"
                    continue
                limits = [float(v) for v in r["bucket_limits"]]
                tensor.histograms[HISTOGRAM_NAME] = self._types.HistogramRecord(
                    bin_edges=(float(r["min"]), *limits),
                    bin_counts=tuple(int(c) for c in r["bucket_counts"]),
                    finite_count=int(r["num"]),
                    nonfinite_count=int(r["nonfinite_count"]),
                    underflow_count=0,
                    overflow_count=0,
                    minimum=float(r["min"]),
                    maximum=float(r["max"]),
                    sum=float(r["sum"]),
                    sum_squares=float(r["sum_squares"]),
                )
            self._deliver()

    def close(self) -> None:
        try:
            self._deliver()
        finally:
            self.sink.close()

    def _deliver(self) -> None:
        event, self._pending = self._pending, None
        if event is None:
            return
        types = self._types
        forward = event.signal == "output"
        calls: dict[tuple[str, int], dict[str, Any]] = {}
        for (layer, call, path), t in event.tensors.items():
            record = types.TensorRecord(
                shape=t.shape,
                dtype=t.dtype,
                device="unknown",
                numel=math.prod(t.shape),
                stats=t.stats,
                unavailable_stats=t.unavailable,
                histograms=t.histograms,
                unavailable_histograms=t.unavailable_histograms,
            )
            calls.setdefault((layer, call), {})[legacy_path(path, gradient=not forward)] = record
        timestamp = event.timestamp
        if forward:
            outputs_by_call = calls
            self._forwards[event.sample_id] = (timestamp, calls)
            while len(self._forwards) > FORWARD_MEMORY:
                self._forwards.popitem(last=False)
            gradients_by_call: dict[tuple[str, int], dict[str, Any]] = {}
        else:
            timestamp, outputs_by_call = self._forwards.get(event.sample_id, (timestamp, {}))
            gradients_by_call = calls
        # As 0.8.0: the backward's record holds every call of its forward, gradients where
        # they arrived; modules in traversal order, calls in call order.
        modules: dict[str, list[Any]] = {}
        order = self._order
        for layer, call in sorted(
            {*outputs_by_call, *gradients_by_call}, key=lambda k: (order.get(k[0], len(order)), k)
        ):
            modules.setdefault(layer, []).append(
                types.ModuleCallRecord(
                    call_index=call,
                    outputs=dict(outputs_by_call.get((layer, call), {})),
                    output_gradients=dict(gradients_by_call.get((layer, call), {})),
                )
            )
        state = (
            types.SampleState.FORWARD_COMPLETE if forward else types.SampleState.BACKWARD_OBSERVED
        )
        self.sink.observe(
            types.SampleRecord(
                schema_version=LEGACY_SCHEMA_VERSION,
                sample_id=event.sample_id,
                forward_index=event.forward_index,
                timestamp=timestamp,
                state=state,
                collection_duration_ms=0.0,
                modules={layer: tuple(records) for layer, records in modules.items()},
                errors=(),
            )
        )

    def __repr__(self) -> str:
        return f"LegacySink({self.sink!r})"


_LEGACY_SIGNALS: Final[frozenset[str]] = frozenset({"output", "output_gradient"})
"""What a 0.8.0 sink can represent (module outputs and their gradients); rows of the parameter
signals are not given to it."""


def _grouped(batch: pa.RecordBatch) -> dict[tuple[int, str], list[dict[str, Any]]]:
    """Rows of ``batch`` by (sample_id, signal), in order; only the signals 0.8.0 had."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in batch.to_pylist():
        if row["signal"] in _LEGACY_SIGNALS:
            groups.setdefault((row["sample_id"], row["signal"]), []).append(row)
    return groups
