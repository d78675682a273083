"""torchinstruments 0.8.0 sinks (``initialize``/``observe``/``close``) fed their own records:
:class:`LegacySink` rebuilds them from today's Arrow batches."""

from __future__ import annotations

import math
import re
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import ModuleType
from typing import Any, Final

import pyarrow as pa
import torch
from torch import nn

from ti_core.legacy import records as look_alikes
from ti_core.legacy.call_site import user_stacklevel
from ti_core.legacy.records import LEGACY_SCHEMA_VERSION, record_types
from ti_core.sink import RunInfo, Sink, SinkCapabilities
from ti_schema.legacy_paths import legacy_path

HISTOGRAM_NAME: Final[str] = "distribution"
"""Name of 0.8.0's default histogram, under which histograms reach a 0.8.0 sink."""
FORWARD_MEMORY: Final[int] = 64
"""Sampled forwards whose outputs are kept for the record of their backward (0.8.0's backward
record also carries the outputs); an older forward's backward record has no outputs."""


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
            stacklevel=user_stacklevel(),
        )
    return adapted[0] if single else adapted


def _parameter_counts(module: nn.Module) -> tuple[int, int]:
    own = list(module.parameters(recurse=False))
    return (
        sum(p.numel() for p in own),
        sum(p.numel() for p in own if p.requires_grad),
    )


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
        self._types: ModuleType = look_alikes
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


__all__ = ["FORWARD_MEMORY", "HISTOGRAM_NAME", "LegacySink", "adapt_sinks", "is_legacy_sink"]
