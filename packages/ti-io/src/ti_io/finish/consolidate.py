"""Finalization: parts -> history.parquet and histograms.parquet, then result.json, index.md.

Shared by ``DirectorySink.close`` and by ``consolidate`` (after a crash). The steps, and how
an interrupted finalization resumes from the step it completed, are the journal's
(:mod:`ti_io.finish.finalization`); this module writes the final files from the parts. Memory stays
bounded: parts are streamed a row group at a time into a ``ParquetWriter`` and aggregates come
from the compact digest built while streaming (:mod:`ti_io.finish.digest`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pyarrow as pa
import pyarrow.parquet as pq

from ti_io.config import HistoryConfig
from ti_io.damaged import SkippedPart
from ti_io.encoding import arrow_footer_metadata, dictionary_columns, dictionary_schema
from ti_io.errors import FinalizationBusyError, FinalizationError, NothingToConsolidateError
from ti_io.facts import RunFacts, read_run_facts
from ti_io.finish.digest import HistoryDigest
from ti_io.finish.disk_store import DiskStore
from ti_io.finish.events import write_events_file
from ti_io.finish.finalization import Resumption, finalize_run, stopped
from ti_io.finish.index_md import write_index
from ti_io.finish.object_store import ObjectStore
from ti_io.finish.result_json import render, write_result_json
from ti_io.finish.run_store import RunStore
from ti_io.integrity import (
    open_verified,
    parquet_rows,
    parquet_write_options,
    read_error,
)
from ti_io.progress import ProgressCallback
from ti_io.publishing import publish_with
from ti_io.read.events import event_records
from ti_io.read.legacy_layout import LegacyRunError
from ti_io.storage import RunLocation, resolve_location
from ti_schema import histogram_schema, history_schema
from ti_schema.layout import (
    HISTOGRAM_PARTS,
    HISTOGRAMS_FILE,
    HISTORY_FILE,
    HISTORY_PARTS,
    RESULT_FILE,
    list_parts,
)

FINAL_COMPRESSION: Final[str] = "zstd"
ROW_GROUP_ROWS: Final[int] = 131_072
"""Rows gathered from parts before a row group is written: bounds finalization memory."""


@dataclass(frozen=True)
class Consolidated:
    """What a finalization did."""

    directory: Path | RunLocation
    """The run (a ``RunLocation`` for a run on an object store)."""
    history_rows: int
    histogram_rows: int
    parts: int
    already_done: bool = False
    resumed_from: str | None = None
    """The journal state an interrupted finalization was resumed from (``"writing"``,
    ``"written"``), or None."""
    skipped: tuple[SkippedPart, ...] = ()
    """Damaged parts left out of the final files (kept in ``damaged/``; the run's record of
    them, from this consolidation or an earlier one)."""


def _read_part(path: Path, read_schema: pa.Schema) -> pa.Table:
    # ParquetFile.read: about half the CPU of pq.read_table for small files. String columns
    # are read as dictionaries: about half the CPU again, and they stay encoded up to the
    # Parquet dictionary pages.
    # Every page is checked against its checksum: a damaged part raises DamagedFileError
    # naming it instead of passing wrong numbers on into the final file.
    strings = [f.name for f in read_schema if pa.types.is_dictionary(f.type)]
    with open_verified(path, read_dictionary=strings) as source:
        try:
            table = source.read(use_threads=False)
        except (OSError, pa.ArrowException) as exc:
            raise read_error(path, exc) from None
    return table.cast(read_schema)


def _read_row_group(
    parts: list[Path], start: int, read_schema: pa.Schema, on_part: Callable[[], None]
) -> tuple[pa.Table, int]:
    """Read ``parts[start:]`` until they hold ``ROW_GROUP_ROWS`` rows (or run out): the rows,
    with one dictionary per string column, and the index of the first part not read."""
    tables = []
    rows = 0
    end = start
    while end < len(parts) and rows < ROW_GROUP_ROWS:
        table = _read_part(parts[end], read_schema)
        tables.append(table)
        rows += table.num_rows
        end += 1
        on_part()
    return pa.concat_tables(tables).unify_dictionaries(), end


def _stream_parts(
    parts: list[Path],
    final: Path,
    schema: pa.Schema,
    digest: HistoryDigest | None = None,
    on_part: Callable[[], None] = lambda: None,
) -> int:
    """Concatenate ``parts`` into ``final`` a row group at a time (folding each row group into
    ``digest``); returns the rows written.

    String columns stay dictionary-encoded from the parts' dictionary pages to the final
    file's, never decoded to strings and hashed again: the writer gets the dictionary arrays
    (same Parquet types as strings), and the footer records ``schema`` itself, so the file
    reads back exactly as if strings had been written (the Arrow types, field docs and schema
    metadata of ``schema``).

    Three stages overlap, each in order on its own thread (pyarrow and Polars release the
    GIL): a reader reads the parts of the next row group, a digester folds the current one
    into ``digest``, and this thread writes it. So two row groups are in memory: the current
    one and the next. ``on_part`` is called after each part is read (progress).
    """
    rows = 0
    read_schema = dictionary_schema(schema)

    def write(tmp: Path) -> None:
        nonlocal rows
        with (
            ThreadPoolExecutor(1, thread_name_prefix="ti-io-read") as reader,
            ThreadPoolExecutor(1, thread_name_prefix="ti-io-digest") as digester,
            pq.ParquetWriter(
                tmp,
                read_schema.remove_metadata(),
                **parquet_write_options(FINAL_COMPRESSION),
                use_dictionary=dictionary_columns(schema),
                store_schema=False,  # the footer records ``schema`` instead (below)
            ) as writer,
        ):
            digested: Future[None] | None = None
            upcoming: Future[tuple[pa.Table, int]] | None = None
            if parts:
                upcoming = reader.submit(_read_row_group, parts, 0, read_schema, on_part)
            while upcoming is not None:
                group, end = upcoming.result()
                upcoming = None
                if end < len(parts):
                    upcoming = reader.submit(_read_row_group, parts, end, read_schema, on_part)
                if digest is not None:
                    if digested is not None:
                        digested.result()  # one row group in flight at most
                    digested = digester.submit(digest.add, group)
                writer.write_table(group, row_group_size=ROW_GROUP_ROWS)
                rows += group.num_rows
            if digested is not None:
                digested.result()
            writer.add_key_value_metadata(arrow_footer_metadata(schema))

    publish_with(final, write)
    return rows


def _producer(facts: RunFacts) -> str:
    return facts.producer or "ti-io (producer unknown)"


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (if enabled) for the duration.

    Finalization allocates tens of thousands of short-lived containers; that triggers a full
    collection, which walks every object of the training process (0.4 s for the 340,000
    objects of a 1,000-layer model, more than the finalization itself). Its own objects are
    freed by reference counting, so pausing avoids the work instead of deferring it. The
    collector's previous state is restored.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def store_at(where: Path | RunLocation) -> RunStore:
    """The :class:`~ti_io.finish.run_store.RunStore` of the run at ``where``: a local
    directory (a path, or a ``RunLocation`` on the local filesystem) or an object-store
    prefix."""
    if isinstance(where, RunLocation):
        if where.local_path is None:
            return ObjectStore(where)
        where = where.local_path
    return DiskStore(where)


def finalize(
    where: Path | RunLocation,
    facts: RunFacts | None = None,
    *,
    window: int | None = None,
    resumption: Resumption | None = None,
    progress: ProgressCallback | None = None,
    skip_damaged: bool = False,
) -> Consolidated:
    """Finalize the run at ``where`` (a directory or an object-store location): write the
    final artifacts from its parts, then retire the parts, resuming an interrupted
    finalization from the step its journal records (:mod:`ti_io.finish.finalization`).

    ``facts``: the run's (``DirectorySink`` knows them); None reads them from the run when the
    files must be written (``window`` overrides the run's). ``resumption``: the command an
    error message names to finish the run. ``progress(done, total)`` is told each part read
    while the files are written. ``skip_damaged``: verify every part first and move the
    damaged ones into ``damaged/`` (:mod:`ti_io.damaged`) instead of stopping at them.
    """
    return _finalize(
        store_at(where),
        facts,
        window=window,
        resumption=resumption or Resumption(window=window, skip_damaged=skip_damaged),
        progress=progress,
        skip_damaged=skip_damaged,
    )


def _finalize(
    store: RunStore,
    facts: RunFacts | None,
    *,
    window: int | None,
    resumption: Resumption,
    progress: ProgressCallback | None,
    skip_damaged: bool,
) -> Consolidated:
    def write_files(work: Path) -> tuple[int, int]:
        run = facts if facts is not None else read_run_facts(work, window=window)
        return _write_final_files(work, run, progress, shown=store.shown)

    with _collector_paused():
        done = finalize_run(store, write_files, resumption, skip_damaged=skip_damaged)
    return Consolidated(
        store.where,
        done.history_rows,
        done.histogram_rows,
        done.parts,
        resumed_from=done.resumed_from.value if done.resumed_from is not None else None,
        skipped=done.skipped,
    )


def _write_final_files(
    directory: Path,
    facts: RunFacts,
    progress: ProgressCallback | None = None,
    *,
    shown: str | None = None,
) -> tuple[int, int]:
    """history.parquet, histograms.parquet, events.parquet, result.json and index.md from the
    parts (each published atomically); returns the rows of history and histograms. ``shown``:
    the run's URI when ``directory`` is the local copy of a run on an object store (index.md
    names it)."""
    history_parts = list_parts(directory / HISTORY_PARTS)
    histogram_parts = list_parts(directory / HISTOGRAM_PARTS)
    on_part = _part_counter(len(history_parts) + len(histogram_parts), progress)
    producer = _producer(facts)
    with HistoryDigest(sum(parquet_rows(part) for part in history_parts)) as digest:
        # The footer records the window of result.json's window means (a contract 1.1 run fact), so
        # readers of the finalized run (``ti summary``) use the run's window, and the run's latest
        # telemetry cost (1.4), which run.json held until now.
        history_rows = _stream_parts(
            history_parts,
            directory / HISTORY_FILE,
            history_schema(producer, window=facts.window, telemetry_cost=facts.telemetry_cost),
            digest,
            on_part,
        )
        # Arrow's allocator keeps the streamed row groups' memory for reuse; handing it back
        # before the aggregation keeps the peak of a 900,000-row finalization near 130 MB
        # instead of 160-200 MB (the training process gets the memory back either way).
        pa.default_memory_pool().release_unused()
        histogram_rows = _stream_parts(
            histogram_parts, directory / HISTOGRAMS_FILE, histogram_schema(producer), None, on_part
        )
        pa.default_memory_pool().release_unused()
        # Before result.json and index.md, which list the events; always written (maybe empty).
        events = event_records(write_events_file(directory, producer, FINAL_COMPRESSION))
        text = render(
            facts.layers,
            digest.aggregated(facts.window, directory / HISTORY_FILE),
            window=facts.window,
            metrics=facts.metrics,
            events=events,
        )
        write_result_json(directory / RESULT_FILE, text)
        write_index(
            directory, facts, digest.facts(histogram_rows), live=False, events=events, shown=shown
        )
        return history_rows, histogram_rows


def _part_counter(total: int, progress: ProgressCallback | None) -> Callable[[], None]:
    """A function to call once per part read, reporting ``progress(done, total)``."""
    if progress is None:
        return lambda: None
    report = progress
    done = 0

    def on_part() -> None:
        nonlocal done
        done += 1
        report(done, total)

    return on_part


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def consolidate(
    output_dir: str | os.PathLike[str] | RunLocation,
    *,
    history_config: HistoryConfig | None = None,
    force: bool = False,
    progress: ProgressCallback | None = None,
    skip_damaged: bool = False,
    filesystem: object | None = None,
) -> Consolidated:
    """Finish an interrupted run: what removing the observer would have done.

    Streams ``history.parts/`` and ``histograms.parts/`` into the final Parquet files, rebuilds
    result.json (layer catalog from the result.json written at attach) and index.md, then
    retires the parts; a finalization that was itself interrupted is resumed from the step its
    journal (``finalization.json``) records, and a finished file is never replaced by one with
    fewer rows. Idempotent: a finalized directory is left as it is (``already_done=True``).
    ``history_config``: window for result.json (default: the run's own; used when the final
    files are written). ``force``: consolidate even though the process that wrote the run still
    seems alive (checked only before a finalization has started). ``progress(done, total)`` is
    called as each part is read (the ``ti`` command draws it). ``skip_damaged``
    (``--skip-damaged``): every part is verified first (page checksums, footer); each damaged
    one is recorded in ``damaged/skipped.json`` and moved into ``damaged/`` (never deleted),
    and the run is consolidated from the rest; ``Consolidated.skipped``, index.md and ``ti
    summary`` name the gap. Without it a damaged part stops the consolidation before anything
    changes (``DamagedPartsError``, naming the option). A finalized run is verified (every
    page of its final files): a damaged one raises ``FinalizationError`` saying that its
    parts are retired.

    Raises NothingToConsolidateError for a directory that holds no run,
    ``ti_io.LegacyRunError`` for one written by torchinstruments 0.8.0 (see ``ti_io.upgrade``),
    RuntimeError while the writer is alive or another process is finalizing it
    (``FinalizationBusyError``), ``ShrinkRefusedError`` when finishing would lose rows, and
    ``FinalizationError`` when an operation fails: nothing is lost, and its message names the
    command that finishes the run.

    ``output_dir`` may be an object-store URI (``s3://bucket/prefix/run``) or a path in
    ``filesystem`` (a pyarrow or fsspec filesystem; :func:`ti_io.storage.resolve_location`):
    the same steps run over objects (:mod:`ti_io.finish.object_store`).
    """
    store = _store_of(output_dir, filesystem)
    if history_config is not None and not isinstance(history_config, HistoryConfig):
        raise TypeError(
            "consolidate(history_config=...) takes a ti_io.HistoryConfig, "
            f"got {type(history_config).__name__}"
        )
    if not isinstance(skip_damaged, bool):
        raise TypeError(f"consolidate(skip_damaged=...) takes True or False, got {skip_damaged!r}")
    window = history_config.window if history_config is not None else None
    resumption = Resumption(force=force, window=window, skip_damaged=skip_damaged)
    if not store.still_there():
        raise NothingToConsolidateError(
            f"consolidate({str(store.where)!r}): no such directory; pass the output_dir of a run"
        )
    try:
        store.refuse_legacy()
        return _consolidate(store, window, force, resumption, progress)
    except (
        FinalizationError,
        FinalizationBusyError,
        NothingToConsolidateError,
        LegacyRunError,
        RuntimeError,
    ):
        raise
    except (OSError, ValueError) as exc:  # reading the run before finalizing: nothing changed
        raise stopped(store, "reading the run", exc, resumption) from exc


def _store_of(
    output_dir: str | os.PathLike[str] | RunLocation, filesystem: object | None
) -> RunStore:
    """The store of ``consolidate``'s run: a plain path stays a path (no URI parsing)."""
    if isinstance(output_dir, RunLocation):
        return store_at(output_dir)
    if filesystem is None and not (isinstance(output_dir, str) and "://" in output_dir):
        return DiskStore(Path(output_dir))
    return store_at(resolve_location(output_dir, filesystem))


def _consolidate(
    store: RunStore,
    window: int | None,
    force: bool,
    resumption: Resumption,
    progress: ProgressCallback | None = None,
) -> Consolidated:
    where = store.where
    try:
        journal = store.read_journal()
    except ValueError as exc:
        raise FinalizationError(
            f"cannot resume the finalization of {where}: {exc}. If {HISTORY_PARTS}/ and "
            f"{HISTOGRAM_PARTS}/ are complete, delete it and run `ti consolidate` again.",
            directory=str(where),
            state=None,
            command=None,
        ) from None
    if journal is None and not store.has_parts(HISTORY_PARTS, HISTOGRAM_PARTS):
        done = store.finished()
        if done is not None:
            return Consolidated(
                where,
                done.history_rows,
                done.histogram_rows,
                0,
                already_done=True,
                skipped=done.skipped,
            )
        ranks = store.rank_names()
        if ranks:
            raise NothingToConsolidateError(
                f"{where} holds rank-private runs ({', '.join(ranks[:4])}"
                f"{', ...' if len(ranks) > 4 else ''}); consolidate each rank "
                f"{store.words.unit}, e.g. `ti consolidate {where / ranks[0]}`"
            )
        raise NothingToConsolidateError(
            f"{where} holds no TorchInstruments run to consolidate: neither "
            f"{HISTORY_PARTS}/ nor {HISTORY_FILE} is there"
        )
    if journal is None and not force:
        # Before a finalization starts, the parts may still be growing: refuse while the
        # writer lives. Once the journal exists its writer has stopped; the finalization lock
        # keeps finalizers apart.
        pid, host = _writer(store.run_facts_text())
        if pid is not None and pid != os.getpid() and host == socket.gethostname() and _alive(pid):
            raise RuntimeError(
                f"{where} is still being written by process {pid} on this host; "
                "remove the observer in that process (it finalizes the run), or pass "
                "force=True (`ti consolidate --force`) if that process is not the writer any "
                "more"
            )
    return _finalize(
        store,
        None,
        window=window,
        resumption=resumption,
        progress=progress,
        skip_damaged=resumption.skip_damaged,
    )


def _writer(run_json: str | None) -> tuple[int | None, str | None]:
    """The process and host that run.json names as the run's writer (None: unknown)."""
    try:
        doc = json.loads(run_json or "{}")
    except ValueError:
        return None, None
    if not isinstance(doc, dict):
        return None, None
    pid, host = doc.get("pid"), doc.get("host")
    return (
        pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
        host if isinstance(host, str) else None,
    )
