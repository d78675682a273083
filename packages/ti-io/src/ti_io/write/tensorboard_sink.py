"""Histograms and scalars as TensorBoard events: in the run directory, or in a caller-owned
writer.

Both paths write the same records: one legacy ``histo`` summary per focus-layer tensor, tagged
by :func:`ti_io.write.tags.histogram_tag`, at ``step = sample_id`` and ``wall_time`` = the tensor's
timestamp. Rows with no finite entries (``num == 0``) have nothing to draw and are left out of
TensorBoard; ``histograms.parquet`` keeps them. Scalars: every available metric of every
focus-layer tensor (the layers with histograms), one ``simple_value`` summary each, tagged by
:func:`ti_io.write.tags.scalar_tag` (``fc/call0/output/std``), at ``step = sample_id``; a null
value (unavailable) is left out. TensorBoard keeps scalars in float32; history.parquet holds the
float64 values.
"""

from __future__ import annotations

import io
import os
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import google_crc32c
import pyarrow as pa
import pyarrow.compute as pc
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.compat.proto.summary_pb2 import HistogramProto

from ti_io.storage import RunLocation, publish_bytes
from ti_io.write.tags import histogram_tag, scalar_tag
from ti_schema.sink import RunInfo, SinkCapabilities


@dataclass(frozen=True)
class HistogramRecord:
    """One histogram ready for TensorBoard."""

    tag: str
    step: int
    wall_time: float
    min: float
    max: float
    num: int
    sum: float
    sum_squares: float
    bucket_limits: list[float]
    bucket_counts: list[int]


def _column(batch: pa.RecordBatch | pa.Table, name: str) -> list[Any]:
    return batch.column(name).to_pylist()  # type: ignore[no-any-return]


def histogram_records(batch: pa.RecordBatch | pa.Table) -> Iterator[HistogramRecord]:
    """The drawable histograms of a ``ti.histograms`` batch, in row order."""
    if batch.num_rows == 0:
        return
    micros = pc.cast(pc.cast(batch.column("timestamp"), pa.timestamp("us")), pa.int64())
    cols = [
        _column(batch, name)
        for name in (
            "layer",
            "call_index",
            "signal",
            "tensor_path",
            "sample_id",
            "min",
            "max",
            "num",
            "sum",
            "sum_squares",
            "bucket_limits",
            "bucket_counts",
        )
    ]
    for (layer, call, signal, path, step, lo, hi, num, total, squares, limits, counts), us in zip(
        zip(*cols, strict=True), micros.to_pylist(), strict=True
    ):
        if not num:
            continue
        yield HistogramRecord(
            tag=histogram_tag(layer, call, signal, path),
            step=step,
            wall_time=us / 1e6,
            min=lo,
            max=hi,
            num=num,
            sum=total,
            sum_squares=squares,
            bucket_limits=limits,
            bucket_counts=counts,
        )


@dataclass(frozen=True)
class ScalarRecord:
    """One scalar ready for TensorBoard."""

    tag: str
    step: int
    wall_time: float
    value: float


def scalar_records(
    batch: pa.RecordBatch | pa.Table, focus: frozenset[str]
) -> Iterator[ScalarRecord]:
    """The available values of the focus layers' rows of a ``ti.history`` batch, in row
    order."""
    if batch.num_rows == 0 or not focus:
        return
    keep = pc.and_(
        pc.is_in(pc.cast(batch.column("layer"), pa.string()), pa.array(sorted(focus))),
        pc.is_valid(batch.column("value")),
    )
    picked = batch.filter(keep)
    if picked.num_rows == 0:
        return
    micros = pc.cast(pc.cast(picked.column("timestamp"), pa.timestamp("us")), pa.int64())
    cols = [
        _column(picked, name)
        for name in ("layer", "call_index", "signal", "tensor_path", "metric", "sample_id", "value")
    ]
    for (layer, call, signal, path, metric, step, value), us in zip(
        zip(*cols, strict=True), micros.to_pylist(), strict=True
    ):
        yield ScalarRecord(scalar_tag(layer, call, signal, path, metric), step, us / 1e6, value)


def _scalar_event(record: ScalarRecord) -> event_pb2.Event:
    return event_pb2.Event(
        wall_time=record.wall_time,
        step=record.step,
        summary=summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=record.tag, simple_value=record.value)]
        ),
    )


def masked_crc32c(data: bytes) -> int:
    """The masked CRC-32C of ``data`` that TensorBoard's record format carries (and its reader
    checks), computed by google-crc32c's C implementation. TensorBoard's own
    (``tensorboard.compat.tensorflow_stub.pywrap_tensorflow.masked_crc32c``) is pure Python:
    about 60 us per 700-byte histogram event on the writer thread, holding the GIL that the
    training thread needs (benchmarks/README.md, sampled-step cost)."""
    crc = int(google_crc32c.value(data))
    rotated = ((crc >> 15) | (crc << 17)) & 0xFFFFFFFF
    return (rotated + 0xA282EAD8) & 0xFFFFFFFF


def _append(writer: RecordFile, events: Iterator[event_pb2.Event]) -> int:
    """Write ``events`` through ``writer``; returns how many."""
    written = 0
    for event in events:
        writer.write(event.SerializeToString())
        written += 1
    return written


class RecordFile:
    """TensorBoard's record framing (as its ``RecordWriter`` writes it) over an open binary
    file: length, masked CRC of the length, data, masked CRC of the data."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file

    def write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._file.write(
            header
            + struct.pack("<I", masked_crc32c(header))
            + data
            + struct.pack("<I", masked_crc32c(data))
        )

    def flush(self) -> None:
        self._file.flush()


def _proto(record: HistogramRecord) -> HistogramProto:
    return HistogramProto(
        min=record.min,
        max=record.max,
        num=record.num,
        sum=record.sum,
        sum_squares=record.sum_squares,
        bucket_limit=record.bucket_limits,
        bucket=record.bucket_counts,
    )


class EventFileHistograms:
    """An event file of our own under ``logdir``, written by the directory sink's writer thread.

    Writes TensorBoard's record format (:class:`RecordFile`, ``event_pb2``) directly rather
    than through ``EventFileWriter``, which would start a second thread; ``flush`` hands the
    bytes to the operating system so a killed process keeps every event flushed so far.
    """

    def __init__(self, logdir: Path) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        name = (
            f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.ti"
        )
        self.path = logdir / name
        self._file: IO[bytes] = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._writer = RecordFile(self._file)
        first = event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")
        self._writer.write(first.SerializeToString())
        self.flush()

    def write(self, batch: pa.RecordBatch | pa.Table) -> int:
        """Append the drawable histograms of ``batch``; returns how many were written."""
        return _append(self._writer, (_event(r) for r in histogram_records(batch)))

    def write_scalars(self, batch: pa.RecordBatch | pa.Table, focus: frozenset[str]) -> int:
        """Append the focus layers' scalars of a history ``batch``; returns how many."""
        return _append(self._writer, (_scalar_event(r) for r in scalar_records(batch, focus)))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        if not self._file.closed:
            try:
                self._writer.flush()
            finally:
                self._file.close()


class EventFileSequence:
    """TensorBoard events on an object store, where a file cannot grow: a sequence of complete
    event files under ``logdir``, one per :meth:`flush` that has events to publish (the
    directory sink's writer flushes once per publication).

    Each file is one object (:func:`ti_io.storage.publish_bytes`) holding the ``file_version``
    record and the events written since the previous flush, named
    ``events.out.tfevents.<start>.<host>.<pid>.<NNNNNN>.ti``: the names sort in the order the
    files were written, which is the order TensorBoard's directory loader reads them in (it
    reads every event file of the directory). Nothing is appended or rewritten; a kill loses
    the events since the last flush, as it does for the local file.
    """

    def __init__(self, logdir: RunLocation) -> None:
        self._logdir = logdir
        self._stem = (
            f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        )
        self._sequence = 0
        self._buffer = io.BytesIO()
        self._writer = RecordFile(self._buffer)
        self._pending = 0
        self.files = 0
        """Event files published so far."""
        self.path: RunLocation = logdir

    def write(self, batch: pa.RecordBatch | pa.Table) -> int:
        """Buffer the drawable histograms of ``batch``; returns how many."""
        written = _append(self._writer, (_event(r) for r in histogram_records(batch)))
        self._pending += written
        return written

    def write_scalars(self, batch: pa.RecordBatch | pa.Table, focus: frozenset[str]) -> int:
        """Buffer the focus layers' scalars of a history ``batch``; returns how many."""
        events = (_scalar_event(r) for r in scalar_records(batch, focus))
        written = _append(self._writer, events)
        self._pending += written
        return written

    def flush(self) -> None:
        """Publish the events buffered since the last flush as the next event file (nothing
        when there are none), written once more at once when that fails; a second failure
        raises, and those events are dropped (the caller reports them lost)."""
        if not self._pending:
            return
        header = io.BytesIO()
        RecordFile(header).write(
            event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString()
        )
        target = self._logdir / f"{self._stem}.{self._sequence:06d}.ti"
        data = header.getvalue() + self._buffer.getvalue()
        self.path = target
        self._sequence += 1
        self._buffer = io.BytesIO()
        self._writer = RecordFile(self._buffer)
        self._pending = 0
        try:
            publish_bytes(target, data)
        except OSError:
            publish_bytes(target, data)
        self.files += 1

    def close(self) -> None:
        self.flush()


def _event(record: HistogramRecord) -> event_pb2.Event:
    return event_pb2.Event(
        wall_time=record.wall_time,
        step=record.step,
        summary=summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=record.tag, histo=_proto(record))]
        ),
    )


class TensorBoardSink:
    """Writes the focus layers' histograms into a caller-owned TensorBoard writer.

    ``logger``: a ``torch.utils.tensorboard.SummaryWriter`` or anything with the same
    ``add_histogram_raw``/``flush`` methods, or a Lightning ``TensorBoardLogger`` (its
    ``experiment`` writer is used). The writer is flushed at ``close`` and never closed: it
    belongs to the caller. ``scalars`` (default True): every available metric of the focus
    layers' rows also as a scalar (``add_scalar``; module docstring); False leaves them to
    Parquet.
    """

    def __init__(self, logger: Any, *, scalars: bool = True) -> None:
        if not isinstance(scalars, bool):
            raise TypeError(f"TensorBoardSink(scalars=...) must be True or False, got {scalars!r}")
        self._scalars = scalars
        self._focus: frozenset[str] = frozenset()
        if not (_is_writer(logger) or hasattr(logger, "experiment")):
            raise TypeError(
                "TensorBoardSink(logger) takes a torch.utils.tensorboard.SummaryWriter or a "
                "Lightning TensorBoardLogger (anything with add_histogram_raw() and flush(), or "
                f"an .experiment that has them); got {type(logger).__name__}"
            )
        self._logger = logger
        self._writer: Any = None

    def capabilities(self) -> SinkCapabilities:
        """Written on the training thread only: the caller may close its writer as soon as its
        training loop ends (Lightning does), which a background write could outlive. On SIGTERM
        and at exit the observer flushes the caller's writer (``flush``), whose own thread
        would otherwise write the events it holds up to two minutes later."""
        return SinkCapabilities(background_writes=False, flush=self.flush)

    def flush(self) -> None:
        """Flush the caller's writer (a closed SummaryWriter ignores it)."""
        if self._writer is not None:
            self._writer.flush()

    def open(self, run: RunInfo) -> None:
        """Resolve the writer (a Lightning logger creates its experiment lazily)."""
        writer = self._logger if _is_writer(self._logger) else self._logger.experiment
        if not _is_writer(writer):
            raise TypeError(
                "TensorBoardSink(logger): logger.experiment has no add_histogram_raw()/flush(); "
                f"got {type(writer).__name__}. Pass a TensorBoard logger or a SummaryWriter."
            )
        if self._scalars and not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(
                f"TensorBoardSink(logger): the writer ({type(writer).__name__}) has no "
                "add_scalar(); pass scalars=False to write histograms only"
            )
        self._writer = writer
        self._focus = frozenset(run.focus_layers) if self._scalars else frozenset()

    def write_history(self, batch: pa.RecordBatch) -> None:
        """Add the focus layers' available values of ``batch`` as scalars (with
        ``scalars=True``); every row stays in history.parquet either way."""
        if self._writer is None:
            raise RuntimeError("TensorBoardSink.write_history called before open()")
        for record in scalar_records(batch, self._focus):
            self._writer.add_scalar(
                record.tag, record.value, global_step=record.step, walltime=record.wall_time
            )

    def write_histograms(self, batch: pa.RecordBatch) -> None:
        """Add every drawable histogram of ``batch`` to the caller's writer."""
        if self._writer is None:
            raise RuntimeError("TensorBoardSink.write_histograms called before open()")
        for record in histogram_records(batch):
            self._writer.add_histogram_raw(
                tag=record.tag,
                min=record.min,
                max=record.max,
                num=record.num,
                sum=record.sum,
                sum_squares=record.sum_squares,
                bucket_limits=record.bucket_limits,
                bucket_counts=record.bucket_counts,
                global_step=record.step,
                walltime=record.wall_time,
            )

    def close(self) -> None:
        """Flush the caller's writer; never close it."""
        if self._writer is not None:
            self._writer.flush()


def _is_writer(obj: Any) -> bool:
    return callable(getattr(obj, "add_histogram_raw", None)) and callable(
        getattr(obj, "flush", None)
    )
