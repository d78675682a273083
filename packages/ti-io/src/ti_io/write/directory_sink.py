"""DirectorySink: the run directory (history, histograms, result.json, index.md, TensorBoard).

Lifecycle (the observer owns it): constructed by the user or by ``output_dir=`` (arguments
checked, no I/O); ``open`` claims the directory (on an object store: checks the prefix holds
no run, which also probes the bucket, the credentials and the endpoint), publishes the layer
catalog and index.md and starts the background writer (:mod:`ti_io.write.parts`, which
publishes the rows on its own clock); ``write_*`` check each batch and hand it to the
writer's buffer; ``close`` stops the writer, which publishes what is buffered, and finalizes
(see :mod:`ti_io.finish.consolidate`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import weakref
from pathlib import Path
from typing import Final, Literal

import pyarrow as pa

from ti_io.config import OBJECT_STORE_BUFFER_ROWS, OBJECT_STORE_FLUSH_SECONDS, HistoryConfig
from ti_io.errors import ArtifactWriteError, FinalizationError
from ti_io.facts import RunFacts, write_run_file
from ti_io.finish.finalization import Resumption
from ti_io.finish.index_md import write_index
from ti_io.finish.result_json import render, write_result_json
from ti_io.publishing import present_artifacts, remove_run_artifacts
from ti_io.remote_run import present_objects, remove_run_objects
from ti_io.storage import RunLocation, resolve_location, storage_error
from ti_io.write.event_parts import EventPartWriter
from ti_io.write.parts import Lost, PartWriter, WriteFailure
from ti_io.write.tensorboard_sink import EventFileHistograms, EventFileSequence
from ti_schema import events_schema, histogram_schema, history_schema
from ti_schema.cost import RunCost
from ti_schema.layout import (
    EVENT_PARTS,
    HISTOGRAM_PARTS,
    HISTORY_PARTS,
    RESULT_FILE,
    TENSORBOARD_DIR,
)
from ti_schema.sink import Barrier, RunInfo, SinkCapabilities

_STRING: Final[pa.DataType] = pa.string()
_Method = Literal["write_history", "write_histograms", "write_events", "write_cost", "flush"]
"""The sink methods that need an open sink (named in their errors)."""


def _check_schema(
    batch: pa.RecordBatch, expected: pa.Schema, what: Literal["write_history", "write_histograms"]
) -> None:
    builder = "history_schema" if what == "write_history" else "histogram_schema"
    names = batch.schema.names
    if names != expected.names:
        raise ValueError(
            f"DirectorySink.{what}: batch columns {names} differ from the contract's "
            f"{expected.names}; build batches with ti_schema.{builder}()"
        )
    for field, want in zip(batch.schema, expected, strict=True):
        typ = field.type
        if typ == want.type:
            continue
        if want.type == _STRING and pa.types.is_dictionary(typ) and typ.value_type == _STRING:
            continue
        raise ValueError(
            f"DirectorySink.{what}: column {field.name!r} has type {typ}; the contract "
            f"(ti_schema.{builder}()) says {want.type}"
        )


def _report(directory: Path | RunLocation, failures: list[WriteFailure]) -> ArtifactWriteError:
    """One error for the failures of a run: what failed writes lost, then (when finalization
    stopped) finalization's own message, which says where the rows are and how to finish."""
    writes = [f for f in failures if f.what != "final artifacts"]
    final = [f for f in failures if f.what == "final artifacts"]
    sentences = []
    if writes:
        lost: dict[Lost, int] = {}
        for f in writes:
            lost[f.what] = lost.get(f.what, 0) + f.rows_lost
        first = writes[0]
        losses = ", ".join(f"{n} {what}" for what, n in lost.items() if n)
        more = f" (and {len(writes) - 1} more failed writes)" if len(writes) > 1 else ""
        sentences.append(
            f"could not write {first.path}: {first.cause}{more}; lost {losses or 'no rows'}. "
            f"Everything already published in {directory} stays readable."
        )
    if final:
        cause = final[0].cause
        sentences.append(
            str(cause)
            if isinstance(cause, FinalizationError)
            else f"finalizing {directory} failed: {type(cause).__name__}: {cause}."
        )
    return ArtifactWriteError(
        " ".join(sentences),
        paths=tuple(dict.fromkeys(str(f.path) for f in failures)),
        rows_lost=sum(f.rows_lost for f in writes if f.what != "TensorBoard histograms"),
    )


class DirectorySink:
    """Writes a run's artifacts under ``output_dir`` (docs/artifacts.md).

    ``output_dir``: the run directory (``output_dir/rank-NNN`` when the run is rank-private):
    a path, or an object-store URI (``s3://bucket/prefix/run``, ``gs://...``), or a path in
    ``filesystem`` (a ``pyarrow.fs.FileSystem`` or an fsspec filesystem;
    :func:`ti_io.storage.resolve_location`). ``history_config``: part size and result.json
    window (on an object store its default publishes every
    :data:`~ti_io.config.OBJECT_STORE_FLUSH_SECONDS` s instead of every second). ``overwrite``:
    replace the artifacts of a previous run in the same directory (only those; other files
    stay). Without it a directory holding a run is refused at ``open``, before anything is
    touched. ``tensorboard_scalars`` (default True): beside the focus layers' histograms, every
    available metric of their rows as a TensorBoard scalar (``fc/call0/output/std``, step =
    sample_id); False writes histograms only.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str] | RunLocation,
        *,
        history_config: HistoryConfig | None = None,
        overwrite: bool = False,
        filesystem: object | None = None,
        tensorboard_scalars: bool = True,
    ) -> None:
        if not isinstance(output_dir, str | os.PathLike | RunLocation):
            raise TypeError(
                "DirectorySink(output_dir) takes a str or os.PathLike path or an object-store "
                f"URI such as 's3://bucket/prefix/run', got {type(output_dir).__name__}"
            )
        if isinstance(output_dir, str) and not output_dir:
            raise ValueError("DirectorySink(output_dir) must not be empty; pass e.g. 'stats'")
        # A local directory keeps its Path and the local code path; only a URI, a
        # RunLocation or a filesystem object resolve to an object-store location.
        remote: RunLocation | None = None
        if (
            filesystem is not None
            or isinstance(output_dir, RunLocation)
            or (isinstance(output_dir, str) and "://" in output_dir)
        ):
            location = resolve_location(output_dir, filesystem)
            if location.local_path is None:
                remote = location
            else:
                output_dir = location.local_path
        self._remote = remote
        if history_config is None:
            history_config = (
                HistoryConfig(
                    buffer_rows=OBJECT_STORE_BUFFER_ROWS, flush_seconds=OBJECT_STORE_FLUSH_SECONDS
                )
                if remote is not None
                else HistoryConfig()
            )
        if not isinstance(history_config, HistoryConfig):
            raise TypeError(
                "DirectorySink(history_config=...) takes a ti_io.HistoryConfig, "
                f"got {type(history_config).__name__}"
            )
        if not isinstance(overwrite, bool):
            raise TypeError(
                f"DirectorySink(overwrite=...) must be True or False, got {overwrite!r}"
            )
        if not isinstance(tensorboard_scalars, bool):
            raise TypeError(
                "DirectorySink(tensorboard_scalars=...) must be True or False, got "
                f"{tensorboard_scalars!r}"
            )
        self.tensorboard_scalars = tensorboard_scalars
        self.output_dir: Path | str = (
            remote.uri if remote is not None else Path(output_dir)  # type: ignore[arg-type]
        )
        self.history_config = history_config
        self.overwrite = overwrite
        self._directory: Path | None = None
        self._location: RunLocation | None = None  # an object-store run, once open
        self._facts: RunFacts | None = None
        self._writer: PartWriter | None = None
        self._event_writer: EventPartWriter | None = None
        self._history_schema: pa.Schema | None = None
        self._histogram_schema: pa.Schema | None = None
        self._closed = False
        self._pid = os.getpid()
        self._barriers: list[Barrier] = []

    @property
    def directory(self) -> Path:
        """The run directory resolved at ``open`` (``output_dir`` or its rank subdirectory);
        for a run on an object store see :attr:`location`."""
        if self._directory is None:
            if self._location is not None:
                raise RuntimeError(
                    f"DirectorySink.directory: {self._location} is on an object store, not a "
                    "local directory; use DirectorySink.location"
                )
            raise RuntimeError("DirectorySink.directory is known only after open()")
        return self._directory

    @property
    def location(self) -> RunLocation:
        """Where the run is, resolved at ``open`` (a local directory or an object-store
        prefix, its rank subdirectory included)."""
        if self._location is not None:
            return self._location
        return resolve_location(self.directory)

    def __repr__(self) -> str:
        return (
            f"DirectorySink({str(self.output_dir)!r}, history_config={self.history_config!r}, "
            f"overwrite={self.overwrite})"
        )

    # -- Sink protocol ---------------------------------------------------------------------

    def capabilities(self) -> SinkCapabilities:
        """Writes may come from the observer's emission worker (they only buffer under a lock);
        ``flush`` and the exit flush wait for the signals it has queued (``attach_barrier``);
        the observer calls ``flush`` when the process is about to end (SIGTERM, exit); events
        go to :meth:`write_events`, which publishes each at once; the run's telemetry cost to
        :meth:`write_cost`."""
        return SinkCapabilities(
            background_writes=True,
            on_barrier=self.attach_barrier,
            flush=self.flush,
            write_events=self.write_events,
            write_cost=self.write_cost,
        )

    def attach_barrier(self, barrier: Barrier) -> None:
        """Called by an observer that writes from a background thread: ``flush`` (and the exit
        flush) first wait for the signals it has queued."""
        self._barriers.append(barrier)

    def _wait_for_writers(self) -> None:
        for barrier in self._barriers:
            barrier()

    def open(self, run: RunInfo) -> None:
        """Claim the directory, publish the catalog and index.md, start the writer."""
        if self._directory is not None or self._location is not None:
            raise RuntimeError(f"{self!r} is already open; use one DirectorySink per run")
        if self._remote is not None:
            self._open_on_store(run)
            return
        directory = self._resolve(run)
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(
                f"output_dir {str(directory)!r} exists and is not a directory; "
                "choose another output_dir"
            )
        found = present_artifacts(directory)
        if found and not self.overwrite:
            raise FileExistsError(
                f"{directory} already holds a TorchInstruments run ({', '.join(found)}); "
                "choose another output_dir, delete that run, or pass "
                "sink=DirectorySink(..., overwrite=True) to replace it"
            )
        directory.mkdir(parents=True, exist_ok=True)
        if found:
            remove_run_artifacts(directory)
        facts = RunFacts.from_run(run, self.history_config.window)
        try:
            (directory / HISTORY_PARTS).mkdir()
            (directory / HISTOGRAM_PARTS).mkdir()
            (directory / EVENT_PARTS).mkdir()
            write_run_file(directory, facts)
            write_result_json(
                directory / RESULT_FILE,
                render(facts.layers, None, window=facts.window, metrics=facts.metrics),
            )
            write_index(directory, facts, None, live=True)
            events = EventFileHistograms(directory / TENSORBOARD_DIR)
        except BaseException:
            remove_run_artifacts(directory)  # only what this open created
            raise
        self._directory = directory
        self._start_writers(directory, run, events, facts)

    def _open_on_store(self, run: RunInfo) -> None:
        """``open`` for an object store: the prefix must hold no run (unless ``overwrite``);
        run.json, result.json and index.md are published (each one object), which also
        proves the bucket, the credentials and the endpoint before training starts. Any
        failure is one StorageError naming the URI and what to check."""
        assert self._remote is not None
        subdir = self._rank_subdir(run)
        location = self._remote.child(subdir) if subdir is not None else self._remote
        try:
            found = present_objects(location)
        except OSError as exc:
            raise storage_error(location, "listing the run's prefix", exc) from None
        if found and not self.overwrite:
            raise FileExistsError(
                f"{location} already holds a TorchInstruments run ({', '.join(found)}); "
                "choose another output_dir, delete that run, or pass "
                "sink=DirectorySink(..., overwrite=True) to replace it"
            )
        facts = RunFacts.from_run(run, self.history_config.window)
        try:
            if found:
                remove_run_objects(location)
            write_run_file(location, facts)
            write_result_json(
                location / RESULT_FILE,
                render(facts.layers, None, window=facts.window, metrics=facts.metrics),
            )
            write_index(location, facts, None, live=True)
        except OSError as exc:
            with contextlib.suppress(OSError):
                remove_run_objects(location)  # only what this open created
            raise storage_error(
                location, "writing the run's first objects (run.json, result.json, index.md)", exc
            ) from None
        events = EventFileSequence(location / TENSORBOARD_DIR)
        self._location = location
        self._start_writers(location, run, events, facts)

    def _start_writers(
        self,
        where: Path | RunLocation,
        run: RunInfo,
        events: EventFileHistograms | EventFileSequence | None,
        facts: RunFacts,
    ) -> None:
        """The writers of an opened run (on disk or on a store; the sink is live from here)."""
        self._history_schema = history_schema(run.producer, window=self.history_config.window)
        self._histogram_schema = histogram_schema(run.producer)
        self._writer = PartWriter(
            where,
            self._history_schema,
            self._histogram_schema,
            history_part_rows=self.history_config.buffer_rows,
            histogram_part_rows=self.history_config.histogram_buffer_rows,
            delay=self.history_config.flush_seconds,
            events=events,
            scalar_layers=frozenset(run.focus_layers) if self.tensorboard_scalars else frozenset(),
        )
        self._event_writer = EventPartWriter(where, events_schema(run.producer))
        self._facts = facts
        self._pid = os.getpid()
        _live_sinks.add(self)

    def write_history(self, batch: pa.RecordBatch) -> None:
        """Buffer ``batch``; the writer publishes it within ``flush_seconds`` (or sooner, when
        ``buffer_rows`` rows are buffered).

        Raises ArtifactWriteError after accepting the batch when an earlier write failed.
        """
        writer = self._require_open("write_history")
        assert self._history_schema is not None
        _check_schema(batch, self._history_schema, "write_history")
        if batch.num_rows:
            writer.add("history", batch)
        self._raise_failures(writer)

    def write_histograms(self, batch: pa.RecordBatch) -> None:
        """Buffer ``batch``; the writer publishes it (TensorBoard events and a histogram part)
        with the history rows, or sooner when ``histogram_buffer_rows`` rows are buffered."""
        writer = self._require_open("write_histograms")
        assert self._histogram_schema is not None
        _check_schema(batch, self._histogram_schema, "write_histograms")
        if batch.num_rows:
            writer.add("histograms", batch)
        self._raise_failures(writer)

    def write_events(self, batch: pa.RecordBatch) -> None:
        """Publish ``batch`` (``ti.events`` rows, ``ti_schema.events_schema()``) at once as its
        own part ``events.parts/part-NNNNNN.parquet``, durably, before returning: an event is
        rare and urgent, and the process may be killed right after it. Also asks the writer to
        publish the buffered history now (without waiting for it), so the rows leading up to
        the event do not wait for ``flush_seconds`` either.

        Raises ValueError/TypeError for a batch that breaks the contract (nothing written),
        ArtifactWriteError when the part cannot be published.
        """
        writer = self._require_open("write_events")
        assert self._event_writer is not None
        self._event_writer.write(batch)
        if batch.num_rows:
            writer.publish_soon()
        self._raise_failures(writer)

    def write_cost(self, cost: RunCost) -> None:
        """Keep the run's latest telemetry cost (:class:`~ti_schema.RunCost`) in its facts:
        ``run.json`` is republished with it at once (a crashed run keeps it for ``ti
        consolidate``), and finalization writes it into the footer of ``history.parquet`` and
        into index.md. Called by the observer at removal, before a flush and at most once a
        minute at a sampled forward. After the end-of-process flush closed the sink (the
        observer's removal may still run afterwards) there is nothing left to update."""
        if self._closed:
            return
        self._require_open("write_cost")
        if not isinstance(cost, RunCost):
            raise TypeError(f"DirectorySink.write_cost takes a ti_schema.RunCost, got {cost!r}")
        where = self._location if self._location is not None else self._directory
        assert where is not None
        assert self._facts is not None
        self._facts = dataclasses.replace(self._facts, telemetry_cost=cost)
        # The figure in memory is what finalization writes; run.json only carries it for a
        # crash. A run.json that cannot be republished (a full disk, a store refusing) keeps
        # its previous figure: the failure that matters is reported by the writes of rows and
        # by finalization, once, not again for this file.
        with contextlib.suppress(Exception):
            write_run_file(where, self._facts)

    def flush(self) -> None:
        """Publish every row received so far as parts and wait until they are on disk.

        Not needed in normal use (removal finalizes); useful before reading a live run with
        ``scan_history``. Raises ArtifactWriteError when a write failed.
        """
        writer = self._require_open("flush")
        self._wait_for_writers()
        writer.flush()
        self._raise_failures(writer)

    def close(self) -> None:
        """Publish the buffered rows, stop the writer, finalize the artifacts. Once only.

        Finalization runs even after write failures, from whatever parts exist; the failures
        are raised afterwards as one ArtifactWriteError.
        """
        if self._closed or self._writer is None:
            self._closed = True
            return
        self._closed = True
        _live_sinks.discard(self)
        writer = self._writer
        failures: list[WriteFailure] = []
        try:
            writer.stop()
        finally:
            failures += writer.take_errors()
        assert self._facts is not None
        where: Path | RunLocation
        if self._location is not None:
            where = self._location
        else:
            assert self._directory is not None
            where = self._directory
        try:
            # Finalization reads with Polars: imported here, so that writing parts never does.
            from ti_io.finish.consolidate import finalize

            # This process wrote run.json and is alive: until the journal exists, a later
            # `ti consolidate` from elsewhere needs --force (the error message says so).
            finalize(where, self._facts, resumption=Resumption(force=True))
        except Exception as exc:
            failures.append(WriteFailure(where, exc, 0, "final artifacts"))
        if failures:
            raise _report(where, failures)

    # -- internals -------------------------------------------------------------------------

    @staticmethod
    def _rank_subdir(run: RunInfo) -> str | None:
        subdir = run.rank_subdir
        if subdir is None:
            return None
        if not subdir or subdir in (".", "..") or "/" in subdir or "\\" in subdir:
            raise ValueError(
                f"RunInfo.rank_subdir must be one plain directory name such as 'rank-001', "
                f"got {subdir!r}"
            )
        return subdir

    def _resolve(self, run: RunInfo) -> Path:
        assert isinstance(self.output_dir, Path)
        subdir = self._rank_subdir(run)
        return self.output_dir if subdir is None else self.output_dir / subdir

    def _require_open(self, what: _Method) -> PartWriter:
        if self._writer is None:
            raise RuntimeError(f"DirectorySink.{what} called before open()")
        if self._closed:
            raise RuntimeError(f"DirectorySink.{what} called after close()")
        return self._writer

    def _raise_failures(self, writer: PartWriter) -> None:
        failures = writer.take_errors()
        if failures:
            where = self._location if self._location is not None else self._directory
            assert where is not None
            raise _report(where, failures)

    def _flush_at_exit(self) -> None:
        """Interpreter exit without removal: publish buffered rows as parts (no finalization),
        so ``ti consolidate`` recovers them."""
        if self._closed or self._writer is None or self._pid != os.getpid():
            return  # a forked child (e.g. a DataLoader worker) owns no writer thread
        self._wait_for_writers()
        self._closed = True
        self._writer.stop()


_live_sinks: weakref.WeakSet[DirectorySink] = weakref.WeakSet()


@atexit.register
def _flush_live_sinks() -> None:
    for sink in list(_live_sinks):
        with contextlib.suppress(Exception):  # exit path: nothing left to report to
            sink._flush_at_exit()
