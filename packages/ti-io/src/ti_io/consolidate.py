"""Finalization: parts -> history.parquet and histograms.parquet, then result.json, index.md.

Shared by ``DirectorySink.close`` and by ``consolidate`` (after a crash). The parts are the
source of truth until they are retired, so a finalization interrupted at any point can simply
be run again. Memory stays bounded: parts are streamed one at a time into a ``ParquetWriter``
and aggregates come from the compact digest built while streaming (:mod:`ti_io.digest`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pyarrow as pa
import pyarrow.parquet as pq

from ti_io.config import HistoryConfig
from ti_io.digest import HistoryDigest
from ti_io.errors import NothingToConsolidateError
from ti_io.facts import RunFacts, read_run_facts
from ti_io.index_md import write_index
from ti_io.layout import (
    HISTOGRAM_PARTS,
    HISTOGRAMS_FILE,
    HISTORY_FILE,
    HISTORY_PARTS,
    RANK_DIR,
    RESULT_FILE,
    list_parts,
    publish_with,
    retire_dir,
)
from ti_io.parts import dictionary_columns
from ti_io.result_json import render, write_result_json
from ti_schema import histogram_schema, history_schema

FINAL_COMPRESSION: Final[str] = "zstd"
ROW_GROUP_ROWS: Final[int] = 131_072
"""Rows gathered from parts before a row group is written: bounds finalization memory."""


@dataclass(frozen=True)
class Consolidated:
    """What a finalization did."""

    directory: Path
    history_rows: int
    histogram_rows: int
    parts: int
    already_done: bool = False


def _read_part(path: Path, schema: pa.Schema) -> pa.Table:
    # ParquetFile.read: about half the CPU of pq.read_table for small files.
    with pq.ParquetFile(path) as source:
        return source.read(use_threads=False).cast(schema)


def _stream_parts(
    parts: list[Path], final: Path, schema: pa.Schema, digest: HistoryDigest | None = None
) -> int:
    """Concatenate ``parts`` into ``final`` part by part (folding each row group into
    ``digest``); returns the rows written.

    Three stages overlap on two helper threads (pyarrow and Polars release the GIL): reading
    the next part, digesting the previous row group, writing the current one. Each stage runs
    in order on its own single thread, so at most one extra part and one extra row group are
    in memory.
    """
    rows = 0

    def write(tmp: Path) -> None:
        nonlocal rows
        with (
            ThreadPoolExecutor(1, thread_name_prefix="ti-io-read") as reader,
            ThreadPoolExecutor(1, thread_name_prefix="ti-io-digest") as digester,
            pq.ParquetWriter(
                tmp,
                schema,
                compression=FINAL_COMPRESSION,
                use_dictionary=dictionary_columns(schema),
            ) as writer,
        ):
            digested: Future[None] | None = None
            pending: list[pa.Table] = []
            pending_rows = 0

            def flush() -> None:
                nonlocal rows, pending, pending_rows, digested
                group = pa.concat_tables(pending)
                if digest is not None:
                    if digested is not None:
                        digested.result()  # one row group in flight at most
                    digested = digester.submit(digest.add, group)
                writer.write_table(group, row_group_size=ROW_GROUP_ROWS)
                rows += pending_rows
                pending, pending_rows = [], 0

            upcoming = reader.submit(_read_part, parts[0], schema) if parts else None
            for index in range(len(parts)):
                assert upcoming is not None
                table = upcoming.result()
                if index + 1 < len(parts):
                    upcoming = reader.submit(_read_part, parts[index + 1], schema)
                pending.append(table)
                pending_rows += table.num_rows
                if pending_rows >= ROW_GROUP_ROWS:
                    flush()
            if pending:
                flush()
            if digested is not None:
                digested.result()

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


def finalize(directory: Path, facts: RunFacts) -> Consolidated:
    """Write the final artifacts of ``directory`` from its parts, then retire the parts.

    Always rebuilds from the parts (none: an empty history), so running it again after an
    interruption gives the same result.
    """
    with _collector_paused():
        return _finalize(directory, facts)


def _finalize(directory: Path, facts: RunFacts) -> Consolidated:
    history_parts = list_parts(directory / HISTORY_PARTS)
    histogram_parts = list_parts(directory / HISTOGRAM_PARTS)
    producer = _producer(facts)
    digest = HistoryDigest()
    history_rows = _stream_parts(
        history_parts, directory / HISTORY_FILE, history_schema(producer), digest
    )
    histogram_rows = _stream_parts(
        histogram_parts, directory / HISTOGRAMS_FILE, histogram_schema(producer)
    )
    text = render(
        facts.layers, digest.aggregated(facts.window), window=facts.window, metrics=facts.metrics
    )
    write_result_json(directory / RESULT_FILE, text)
    write_index(directory, facts, digest.facts(histogram_rows), live=False)
    retire_dir(directory / HISTORY_PARTS)
    retire_dir(directory / HISTOGRAM_PARTS)
    return Consolidated(
        directory, history_rows, histogram_rows, len(history_parts) + len(histogram_parts)
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def consolidate(
    output_dir: str | os.PathLike[str],
    *,
    history_config: HistoryConfig | None = None,
    force: bool = False,
) -> Consolidated:
    """Finish an interrupted run: what removing the observer would have done.

    Streams ``history.parts/`` and ``histograms.parts/`` into the final Parquet files, rebuilds
    result.json (layer catalog from the result.json written at attach) and index.md, then
    removes the parts. Idempotent: a finalized directory is left as it is
    (``already_done=True``). ``history_config``: window for result.json (default: the run's
    own). ``force``: consolidate even though the process that wrote the run still seems alive.
    Raises NothingToConsolidateError for a directory that holds no run.
    """
    directory = Path(output_dir)
    if history_config is not None and not isinstance(history_config, HistoryConfig):
        raise TypeError(
            "consolidate(history_config=...) takes a ti_io.HistoryConfig, "
            f"got {type(history_config).__name__}"
        )
    if not directory.is_dir():
        raise NothingToConsolidateError(
            f"consolidate({str(directory)!r}): no such directory; pass the output_dir of a run"
        )
    has_parts = (directory / HISTORY_PARTS).is_dir() or (directory / HISTOGRAM_PARTS).is_dir()
    if not has_parts:
        if (directory / HISTORY_FILE).is_file():
            rows = pq.read_metadata(directory / HISTORY_FILE).num_rows
            hist = directory / HISTOGRAMS_FILE
            hist_rows = pq.read_metadata(hist).num_rows if hist.is_file() else 0
            return Consolidated(directory, rows, hist_rows, 0, already_done=True)
        ranks = sorted(c.name for c in directory.iterdir() if RANK_DIR.fullmatch(c.name))
        if ranks:
            raise NothingToConsolidateError(
                f"{directory} holds rank-private runs ({', '.join(ranks[:4])}"
                f"{', ...' if len(ranks) > 4 else ''}); consolidate each rank directory, e.g. "
                f"`ti consolidate {directory / ranks[0]}`"
            )
        raise NothingToConsolidateError(
            f"{directory} holds no TorchInstruments run to consolidate: neither "
            f"{HISTORY_PARTS}/ nor {HISTORY_FILE} is there"
        )
    facts = read_run_facts(
        directory, window=history_config.window if history_config is not None else None
    )
    if (
        not force
        and facts.pid is not None
        and facts.pid != os.getpid()
        and facts.host == socket.gethostname()
        and _alive(facts.pid)
    ):
        raise RuntimeError(
            f"{directory} is still being written by process {facts.pid} on this host; "
            "remove the observer in that process (it finalizes the run), or pass force=True "
            "(`ti consolidate --force`) if that process is not the writer any more"
        )
    return finalize(directory, facts)
