"""Every rank's rows of a run, a range of steps at a time: the cross-rank readers' input.

The cross-rank readers (:func:`~ti_dist.compare_ranks`, :func:`~ti_dist.replica_drift`,
:func:`~ti_dist.combine_shards`, ``ti drift``) line rows up across ranks by ``sample_id`` or
``forward_index``: everything they compute for one step reads only that step's rows. So a run
directory is read once, a row group at a time (``ti_io.read.row_groups``: checksums verified,
strings as dictionaries), and each row is routed by the range of steps it belongs to into a
partition (``ti_io.read.spill``: on disk when the run is long); each partition then holds every
rank's rows of its steps and is handed to the reader as one Polars frame, in step order. Memory
holds one partition (a few million rows) whatever the number of ranks and steps.

The strings of a row (layer, signal, tensor path, metric, run id) travel as one measurement id
(``ti_io.read.keys``) and are decoded per partition. A frame given instead of a directory is
used as it is (the caller holds it in memory already).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ti_dist.reading import find_history_sources
from ti_io.facts import EVERY_RANK_POLICIES, recorded_world
from ti_io.integrity import read_footer
from ti_io.progress import ProgressCallback, Steps
from ti_io.read.frames import PathOrFrame, history_frame, plain_strings
from ti_io.read.keys import KeyCatalog
from ti_io.read.row_groups import check_contract, read_row_groups
from ti_io.read.spill import Partitions, partition_count
from ti_io.storage import RunLocation
from ti_schema.layout import HISTORY_FILE, HISTORY_PARTS, list_rank_dirs, rank_dir_name

KEYS: Final[tuple[str, ...]] = ("layer", "call_index", "signal", "tensor_path", "metric", "run_id")
"""The string and integer columns a row's measurement id stands for."""

CROSS_RANK_FACTOR: Final[int] = 4
"""A partition of steps holds ``ti_io.read.spill.partition_rows() / CROSS_RANK_FACTOR`` rows."""

Keep = Callable[[dict[str, Any]], bool]
"""Whether a measurement's rows are read (``KEYS`` by name), decided once per measurement."""


class RankPartitions:
    """Every rank's rows of ``source``, partitioned by ranges of ``align`` (``sample_id`` or
    ``forward_index``); a context manager (partition files are removed on exit).

    ``source``: a run's ``output_dir`` (every ``rank-NNN/``, finalized or live, as
    :func:`~ti_dist.scan_ranks` reads it; on object storage, a URI or ``RunLocation``: its
    objects are copied into a private temporary directory first) or a frame of ``ti.history``
    rows. ``keep``: which
    measurements are read. ``extra``: further columns each frame carries (``shape``...).
    Frames have ``KEYS``, ``align``, ``rank``, ``value`` and ``extra``. :attr:`ranks` are every
    rank with rows in ``source``, kept or not; :attr:`metrics` every metric name.
    ``progress(done, total)`` is told the rows read, then the rows of each partition handed out
    (total: twice the rows).
    """

    def __init__(
        self,
        source: PathOrFrame,
        *,
        align: str,
        keep: Keep | None = None,
        extra: Sequence[str] = (),
        progress: ProgressCallback | None = None,
    ) -> None:
        self._align = align
        self._progress = progress
        self._steps = Steps(None, 0)
        self._extra = tuple(extra)
        self._frame: pl.LazyFrame | None = None
        self._partitions: Partitions | None = None
        self.ranks: list[int] = []
        self.metrics: list[str] = []
        self.rows = 0
        """Rows read (kept or not)."""
        self.kept_rows = 0
        """Rows of the kept measurements."""
        if isinstance(source, pl.DataFrame | pl.LazyFrame) or not isinstance(
            source, str | os.PathLike | RunLocation
        ):
            self._read_frame(source, keep)
            return
        self._catalog = KeyCatalog(KEYS, None if keep is None else _by_name(keep))
        from ti_io.read.remote import local_copy, local_path, remote_location

        remote = remote_location(source)
        if remote is None:
            self._read(local_path(source))
            return
        # A run on object storage: its objects are copied (read only) into a private
        # directory, read into the partitions, and the copy removed.
        with local_copy(remote) as copy:
            self._read(copy, shown=remote.uri)

    def __enter__(self) -> RankPartitions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._partitions is not None:
            self._partitions.close()

    def _read_frame(self, source: PathOrFrame, keep: Keep | None) -> None:
        frame = plain_strings(history_frame(source, _no_scan), check=True)
        # A frame may hold only the columns its reader needs (a test's, say).
        present = [name for name in KEYS if name in frame.collect_schema().names()]
        facts = frame.select(
            pl.col("rank").cast(pl.Int32).unique().sort().implode().alias("ranks"),
            pl.col("metric").cast(pl.String).unique().sort().implode().alias("metrics"),
            pl.len().alias("rows"),
        ).collect()
        self.ranks = [r for r in facts.item(0, "ranks") if r is not None]
        self.metrics = [m for m in facts.item(0, "metrics") if m is not None]
        self.rows = int(facts.item(0, "rows"))
        self._measurements = frame.select(present).unique().collect()
        if keep is not None:
            measurements = self._measurements
            chosen = [
                bool(keep({name: row.get(name) for name in KEYS}))
                for row in measurements.iter_rows(named=True)
            ]
            kept = measurements.filter(pl.Series(chosen, dtype=pl.Boolean))
            frame = frame.join(kept.lazy(), on=present, how="semi", nulls_equal=True)
        self.kept_rows = int(frame.select(pl.len()).collect().item())
        self._frame = frame

    def _read(self, output_dir: Path, shown: str | None = None) -> None:
        sources = find_history_sources(output_dir)
        if not sources:
            raise FileNotFoundError(
                f"no history found under output_dir {shown or str(output_dir)!r}: expected "
                f"{HISTORY_FILE} or {HISTORY_PARTS}/ parts in it or in its rank-NNN/ subfolders"
            )
        _check_every_rank(output_dir, shown)
        files = [path for source in sources for path in source.files]
        footers = [read_footer(path) for path in files]
        for path, footer in zip(files, footers, strict=True):
            check_contract(path, footer)
        total = sum(footer.num_rows for footer in footers)
        self._steps = Steps(self._progress, 2 * total)
        low, high = _span(files, self._align)
        # A quarter of a measurement partition's rows: a reader across ranks works on several
        # copies of its partition (per rank, per measurement and step, with list columns).
        count = partition_count(total * CROSS_RANK_FACTOR)
        width = max(1, -(-(high - low + 1) // count))
        schema = pa.schema(
            [
                pa.field("key", pa.uint32(), nullable=False),
                pa.field(self._align, pa.int64()),
                pa.field("rank", pa.int32()),
                pa.field("value", pa.float64()),
                *(pq.read_schema(files[0]).field(name) for name in self._extra),
            ]
        )
        self._partitions = Partitions(schema, count)
        ranks: set[int] = set()
        metrics: set[str] = set()
        columns = [*KEYS, self._align, "rank", "value", *self._extra]
        for group in read_row_groups(files, columns):
            table = group.table
            self.rows += table.num_rows
            self._steps.advance(table.num_rows)
            ranks.update(r for r in pc.unique(table.column("rank")).to_pylist() if r is not None)
            ids = self._catalog.ids(table.select(list(KEYS)))
            kept = self._catalog.kept[ids]
            if not kept.any():
                continue
            chosen = pa.array(kept)
            self.kept_rows += int(kept.sum())
            step = table.column(self._align).filter(chosen).combine_chunks().cast(pa.int64())
            steps = step.to_numpy(zero_copy_only=False)
            arrays = [
                pa.array(ids[kept]),
                step,
                table.column("rank").filter(chosen).combine_chunks().cast(pa.int32()),
                table.column("value").filter(chosen).combine_chunks().cast(pa.float64()),
                *(table.column(name).filter(chosen).combine_chunks() for name in self._extra),
            ]
            batch = pa.record_batch(arrays, schema=schema)
            self._partitions.add(batch, (steps - low) // width)
        metric_at = KEYS.index("metric")
        metrics.update(str(self._catalog.key(i)[metric_at]) for i in range(len(self._catalog)))
        self.ranks = sorted(ranks)
        self.metrics = sorted(metrics)
        self._measurements = self._catalog.frame().drop("key")

    def measurements(self) -> pl.DataFrame:
        """Every measurement of ``source`` (``KEYS``), kept or not."""
        return self._measurements

    def frames(self) -> Iterator[pl.DataFrame]:
        """Each partition (every rank's kept rows of a range of steps), in step order; one at
        a time. The string columns of a run directory's partitions are ``pl.Categorical`` (four
        bytes a row instead of the strings; readers cast what they return with
        :func:`plain`)."""
        if self._frame is not None:
            yield self._frame.collect()
            return
        assert self._partitions is not None
        catalog = self._catalog.frame().with_columns(pl.col(pl.String).cast(pl.Categorical))
        self._steps.advance(self.rows - self.kept_rows)
        for frame in self._partitions.frames():
            self._steps.advance(frame.height)
            yield frame.join(catalog, on="key", how="left").drop("key")


def plain(frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` with its categorical columns (a partition's strings) as plain strings: what
    the readers return."""
    return frame.with_columns(pl.col(pl.Categorical).cast(pl.String))


def _check_every_rank(output_dir: Path, shown: str | None) -> None:
    """Raise FileNotFoundError naming the rank directories a run that recorded every rank
    lacks (not copied, or deleted): a comparison across the ranks present would silently leave
    them out."""
    present = {rank: directory for rank, directory in list_rank_dirs(output_dir)}
    expected = 0
    for directory in present.values():
        world, policy = recorded_world(directory)
        if world and policy in EVERY_RANK_POLICIES:
            expected = max(expected, world)
    missing = [rank_dir_name(rank) for rank in range(expected) if rank not in present]
    if missing:
        named = ", ".join(f"{name}/" for name in missing[:8]) + (
            ", ..." if len(missing) > 8 else ""
        )
        lacking = f"{missing[0]}/ is" if len(missing) == 1 else f"{len(missing)} ranks are"
        raise FileNotFoundError(
            f"{shown or output_dir}: the run recorded every rank of a world of {expected} "
            f"(rank_policy 'all'), but {lacking} missing ({named}). Copy them in (a partial "
            "copy of the run?); to read the ranks that are here, pass their rows as a frame, "
            "e.g. ti_dist.scan_ranks(output_dir)"
        )


def _by_name(keep: Keep) -> Callable[[tuple[Any, ...]], bool]:
    def by_tuple(key: tuple[Any, ...]) -> bool:
        return keep(dict(zip(KEYS, key, strict=True)))

    return by_tuple


def _no_scan(path: str | os.PathLike[str]) -> pl.LazyFrame:  # pragma: no cover - never a path
    raise AssertionError(f"a path goes through RankPartitions._read, got {path!r}")


def _span(files: Sequence[Path], column: str) -> tuple[int, int]:
    """The smallest and largest ``column`` value of ``files``: from their row groups'
    statistics, or read where a row group has none."""
    low: int | None = None
    high: int | None = None
    for path in files:
        metadata = pq.read_metadata(path)
        at = metadata.schema.to_arrow_schema().get_field_index(column)
        for index in range(metadata.num_row_groups):
            group = metadata.row_group(index)
            if not group.num_rows:
                continue
            stats = group.column(at).statistics
            if stats is not None and stats.has_min_max:
                lo, hi = int(stats.min), int(stats.max)
            else:
                values = pq.ParquetFile(path).read_row_group(index, columns=[column])
                lo_value, hi_value = pc.min_max(values.column(column)).values()
                if lo_value.as_py() is None:
                    continue
                lo, hi = int(lo_value.as_py()), int(hi_value.as_py())
            low = lo if low is None else min(low, lo)
            high = hi if high is None else max(high, hi)
    return (0, 0) if low is None or high is None else (low, high)


__all__ = ["KEYS", "RankPartitions", "plain"]
