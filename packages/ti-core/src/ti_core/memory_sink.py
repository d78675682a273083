"""A sink that keeps every record in memory (tests, notebooks, production without ti-io)."""

from __future__ import annotations

import threading

import pyarrow as pa

from ti_core.sink import Barrier, RunCost, RunInfo, SinkCapabilities
from ti_schema import events_schema, histogram_schema, history_schema


class MemorySink:
    """Keeps the batches it receives; ``table()`` and ``histograms()`` concatenate them.

    It may be reused by several runs in turn; each run's rows carry their own ``run_id``.
    Reads include every signal that ended before them, also while an observer reduces and
    writes on its emission worker.
    """

    def __init__(self) -> None:
        self._history: list[pa.RecordBatch] = []
        self._histograms: list[pa.RecordBatch] = []
        self._events: list[pa.RecordBatch] = []
        self._lock = threading.Lock()
        self.runs: list[RunInfo] = []
        """Every RunInfo this sink was opened with, in order."""
        self.open_count = 0
        self.close_count = 0
        self._barriers: list[Barrier] = []
        self.cost: RunCost | None = None
        """The latest telemetry cost of the run (``write_cost``; final once closed)."""

    @property
    def run(self) -> RunInfo | None:
        """The RunInfo of the latest ``open``."""
        return self.runs[-1] if self.runs else None

    @property
    def is_open(self) -> bool:
        return self.open_count > self.close_count

    def open(self, run: RunInfo) -> None:
        with self._lock:
            self.runs.append(run)
            self.open_count += 1

    def write_history(self, batch: pa.RecordBatch) -> None:
        with self._lock:
            self._history.append(batch)

    def write_histograms(self, batch: pa.RecordBatch) -> None:
        with self._lock:
            self._histograms.append(batch)

    def write_events(self, batch: pa.RecordBatch) -> None:
        """Keep one ``ti.events`` batch (declared in :meth:`capabilities`)."""
        with self._lock:
            self._events.append(batch)

    def write_cost(self, cost: RunCost) -> None:
        """Keep the run's latest telemetry cost as :attr:`cost` (declared in
        :meth:`capabilities`)."""
        self.cost = cost

    def events(self) -> pa.Table:
        """Every ``ti.events`` row received so far (an empty table with the schema if none)."""
        with self._lock:
            batches = list(self._events)
        if not batches:
            return events_schema(self._producer()).empty_table()
        return pa.Table.from_batches(batches)

    def close(self) -> None:
        with self._lock:
            self.close_count += 1

    def capabilities(self) -> SinkCapabilities:
        """Writes may come from the observer's emission worker (they append under a lock);
        reads wait for the signals it has queued (``attach_barrier``); it keeps the run's
        events (``write_events``) and its telemetry cost (``write_cost``)."""
        return SinkCapabilities(
            background_writes=True,
            on_barrier=self.attach_barrier,
            write_events=self.write_events,
            write_cost=self.write_cost,
        )

    def attach_barrier(self, barrier: Barrier) -> None:
        """Called by an observer that writes from a background thread: reads first wait for
        the signals it has queued."""
        with self._lock:
            self._barriers.append(barrier)

    def _wait_for_writers(self) -> None:
        with self._lock:
            barriers = list(self._barriers)
        for barrier in barriers:
            barrier()

    def _producer(self) -> str | None:
        return self.run.producer if self.run is not None else None

    def table(self) -> pa.Table:
        """Every ``ti.history`` row received so far (an empty table with the schema if none)."""
        self._wait_for_writers()
        with self._lock:
            batches = list(self._history)
        schema = batches[0].schema if batches else history_schema(self._producer())
        return pa.Table.from_batches(batches, schema=schema)

    def histograms(self) -> pa.Table:
        """Every ``ti.histograms`` row received so far."""
        self._wait_for_writers()
        with self._lock:
            batches = list(self._histograms)
        schema = batches[0].schema if batches else histogram_schema(self._producer())
        return pa.Table.from_batches(batches, schema=schema)

    def __repr__(self) -> str:
        return (
            f"MemorySink(batches={len(self._history)}, histogram_batches={len(self._histograms)})"
        )
