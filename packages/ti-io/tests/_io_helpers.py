"""Synthetic runs for sink-level tests: RunInfo and batches built against ti-schema (no torch)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ti_io import DirectorySink, HistoryConfig
from ti_schema import DEFAULT_METRICS, LayerInfo, RunInfo, histogram_schema, history_schema

PRODUCER = "ti-io tests"
START = datetime(2026, 1, 1, tzinfo=UTC)


def make_run(
    layers: tuple[tuple[str, str], ...] = (("encoder.0", "Linear"), ("encoder.1", "ReLU")),
    *,
    focus: tuple[str, ...] | None = None,
    rank_subdir: str | None = None,
    metrics: tuple[str, ...] = DEFAULT_METRICS,
) -> RunInfo:
    infos = tuple(LayerInfo(name, kind) for name, kind in layers)
    return RunInfo(
        run_id="run-1",
        rank=0,
        world_size=1,
        producer=PRODUCER,
        started_at=START,
        layers=infos,
        focus_layers=tuple(focus if focus is not None else [i.name for i in infos][:8]),
        metrics=metrics,
        sampler="EveryNForwardsSampler(n=1)",
        rank_subdir=rank_subdir,
        settings={"error_policy": "warn"},
    )


@dataclass
class Synth:
    """Deterministic synthetic samples of a run: history and histogram batches."""

    run: RunInfo
    seed: int = 0
    empty_every: int = 0
    """Every n-th sample, the last layer's gradient is an empty tensor (unavailable values)."""
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def tensors(self, sample: int) -> Iterator[tuple[str, str, str]]:
        types = {i.name: i.module_type for i in self.run.layers}
        executed = [i.name for i in self.run.layers]
        for signal in ("output", "output_gradient"):
            for layer in executed:
                yield layer, types[layer], signal

    def history(self, sample: int, *, dictionary: bool = False) -> pa.RecordBatch:
        cols: dict[str, list[Any]] = {n: [] for n in history_schema().names}
        ts = START + timedelta(seconds=sample)
        last = self.run.layers[-1].name
        for layer, kind, signal in self.tensors(sample):
            empty = (
                self.empty_every
                and sample % self.empty_every == 0
                and layer == last
                and signal == "output_gradient"
            )
            for metric in self.run.metrics:
                value = None if empty else float(self.rng.normal(loc=sample * 0.01, scale=1.0))
                row = {
                    "run_id": self.run.run_id,
                    "rank": 0,
                    "sample_id": sample,
                    "forward_index": sample * 2,
                    "timestamp": ts,
                    "layer": layer,
                    "module_type": kind,
                    "call_index": 0,
                    "signal": signal,
                    "tensor_path": "",
                    "mode": "train",
                    "grad_enabled": True,
                    "shape": [0, 4] if empty else [8, 4],
                    "dtype": "float32",
                    "metric": metric,
                    "value": value,
                    "unavailable_reason": "empty tensor (numel=0)" if empty else None,
                }
                for k, v in row.items():
                    cols[k].append(v)
        table = pa.table(cols, schema=history_schema(PRODUCER))
        if dictionary:
            table = table.cast(
                pa.schema(
                    [
                        f.with_type(pa.dictionary(pa.int32(), pa.string()))
                        if f.name in ("layer", "metric", "signal")
                        else f
                        for f in table.schema
                    ],
                    metadata=table.schema.metadata,
                )
            )
        return table.to_batches()[0]

    def histograms(self, sample: int) -> pa.RecordBatch:
        cols: dict[str, list[Any]] = {n: [] for n in histogram_schema().names}
        ts = START + timedelta(seconds=sample)
        types = {i.name: i.module_type for i in self.run.layers}
        for signal in ("output", "output_gradient"):
            for layer in self.run.focus_layers:
                values = self.rng.normal(size=64)
                counts, edges = np.histogram(values, bins=10)
                row = {
                    "run_id": self.run.run_id,
                    "rank": 0,
                    "sample_id": sample,
                    "forward_index": sample * 2,
                    "timestamp": ts,
                    "layer": layer,
                    "module_type": types[layer],
                    "call_index": 0,
                    "signal": signal,
                    "tensor_path": "",
                    "mode": "train",
                    "grad_enabled": True,
                    "shape": [8, 8],
                    "dtype": "float32",
                    "bucket_limits": [float(e) for e in edges[1:]],
                    "bucket_counts": [int(c) for c in counts],
                    "min": float(values.min()),
                    "max": float(values.max()),
                    "num": 64,
                    "sum": float(values.sum()),
                    "sum_squares": float(values @ values),
                    "nonfinite_count": 0,
                }
                for k, v in row.items():
                    cols[k].append(v)
        return pa.table(cols, schema=histogram_schema(PRODUCER)).to_batches()[0]


NO_ROW = object()
"""A sample at which a run writes no row for a series (a gradient that did not arrive)."""

Series = Mapping[tuple[str, str, str], Sequence[float | object | None]]
"""(layer, signal, metric) -> the value at each sample id (None: a row with a null value)."""


def interrupted_run(out: Path, s: Synth, samples: int = 5) -> Path:
    """A run whose process died after publishing every row as parts (no finalization)."""
    sink = DirectorySink(out, history_config=HistoryConfig(buffer_rows=30))
    sink.open(s.run)
    for i in range(samples):
        sink.write_history(s.history(i))
        sink.write_histograms(s.histograms(i))
    sink._flush_at_exit()  # the interpreter-exit path: parts published, nothing finalized
    return out


def write_run(
    directory: Path,
    series: Series,
    *,
    layers: Sequence[str] = ("fc1", "act", "fc2"),
    window: int = 3,
    finalize: bool = True,
    first_sample: int = 0,
    events: Sequence[pa.RecordBatch] = (),
    metrics: tuple[str, ...] = DEFAULT_METRICS,
) -> Path:
    """A run directory written by DirectorySink holding exactly ``series`` (and ``events``);
    sample ``s`` is taken at root forward ``5 * s``."""
    run = make_run(tuple((name, "Linear") for name in layers), metrics=metrics)
    sink = DirectorySink(directory, history_config=HistoryConfig(buffer_rows=64, window=window))
    sink.open(run)
    samples = max(len(v) for v in series.values())
    for i in range(samples):
        sample = first_sample + i
        rows: dict[str, list[Any]] = {name: [] for name in history_schema().names}
        for (layer, signal, metric), values in series.items():
            if i >= len(values) or values[i] is NO_ROW:
                continue
            value = values[i]
            row = {
                "run_id": run.run_id,
                "rank": 0,
                "sample_id": sample,
                "forward_index": 5 * sample,
                "timestamp": START + timedelta(seconds=sample),
                "layer": layer,
                "module_type": "Linear",
                "call_index": 0,
                "signal": signal,
                "tensor_path": "",
                "mode": "train",
                "grad_enabled": True,
                "shape": [8, 4],
                "dtype": "float32",
                "metric": metric,
                "value": value,
                "unavailable_reason": "no finite entries" if value is None else None,
            }
            for name, item in row.items():
                rows[name].append(item)
        sink.write_history(pa.table(rows, schema=history_schema("ti-io tests")).to_batches()[0])
    for batch in events:
        sink.write_events(batch)
    if finalize:
        sink.close()
    else:
        sink.flush()
        sink._flush_at_exit()  # what the interpreter-exit hook does: parts, no finalization
    return directory
