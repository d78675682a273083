"""What finalization learns from the history while streaming it, a row group at a time.

Finalization (and ``ti upgrade``) writes history.parquet a row group at a time and folds each
row group into a :class:`HistoryDigest`: the aggregation of :mod:`ti_io.read.measurements`,
whose memory does not grow with the history (long histories are partitioned on disk). Once the
file is written, :meth:`HistoryDigest.aggregated` gives result.json's aggregates (reading the
few rows that hold each measurement's latest shape, dtype and module type back from the written
file) and :meth:`HistoryDigest.facts` index.md's counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Final

import polars as pl
import pyarrow as pa

from ti_io.finish.index_md import HistoryFacts
from ti_io.read.measurements import Measurements
from ti_io.read.row_groups import HistoryFiles, read_rows

_UNAVAILABLE_LINES: Final[int] = 40


class HistoryDigest:
    """Accumulates result.json's aggregates and index.md's counts from ``ti.history`` row
    groups; a context manager that removes its partition files on exit.

    ``expected_rows``: the rows that will be added (from the parts' footers: it sets how the
    digest partitions them). ``directory``: where partitions of a long history are written
    (None: the system's temporary directory).
    """

    def __init__(self, expected_rows: int = 0, directory: Path | None = None) -> None:
        self._measurements = Measurements(expected_rows, directory=directory)
        self._written: Path | None = None

    def __enter__(self) -> HistoryDigest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._measurements.close()

    @property
    def rows(self) -> int:
        return self._measurements.rows

    def add(self, part: pa.Table) -> None:
        """Fold the next rows (a conforming ``ti.history`` table, string columns plain or
        dictionary-encoded) into the digest, in the order they are written."""
        self._measurements.add(part)

    def aggregated(self, window: int, written: Path | None = None) -> pl.DataFrame:
        """One row per (tensor, metric): the columns ``result_json.render`` reads. ``written``:
        the history file the rows were written to, in the order they were added (the latest
        shape, dtype and module type of each measurement are read from it)."""
        if written is not None:
            self._written = written
        fetch = None
        if self._written is not None:
            files = HistoryFiles((self._written,), (self.rows,), True)

            def fetch(rows: Sequence[int], columns: Sequence[str]) -> pa.Table:
                return read_rows(files, rows, columns)

        return self._measurements.aggregated(window, fetch)

    def facts(self, histogram_rows: int | None) -> HistoryFacts:
        """Counts for index.md (after :meth:`aggregated`)."""
        measurements = self._measurements
        if not measurements.rows:
            return HistoryFacts(histograms=histogram_rows)
        table = measurements.result
        if table is None:
            raise RuntimeError(
                "HistoryDigest.facts() reads the aggregates: call aggregated() first"
            )
        per_layer = table.group_by("layer", maintain_order=True).agg(
            pl.col("rows").sum(), pl.col("unavailable").sum()
        )
        catalog = measurements.catalog
        missing = sorted(
            (
                (*_named(catalog.key(key)), reason, count)
                for (key, reason), count in measurements.reasons.items()
            ),
            key=lambda r: (-r[4], r[0], r[1], r[2]),
        )[:_UNAVAILABLE_LINES]
        samples = measurements.samples()
        first_time, last_time = measurements.time_span()
        return HistoryFacts(
            rows=measurements.rows,
            samples=len(samples),
            first_sample=int(samples[0]) if len(samples) else None,
            last_sample=int(samples[-1]) if len(samples) else None,
            first_time=first_time,
            last_time=last_time,
            layer_rows={
                layer: (int(rows), int(nulls)) for layer, rows, nulls in per_layer.iter_rows()
            },
            unavailable=missing,
            unavailable_total=sum(measurements.reasons.values()),
            histograms=histogram_rows,
        )


def _named(key: tuple[object, ...]) -> tuple[str, str, str]:
    """(layer, signal, metric) of a measurement's ``GROUP_KEYS`` tuple."""
    return str(key[0]), str(key[2]), str(key[6])


__all__ = ["HistoryDigest"]
