"""What finalization learns from the history while streaming it, a row group at a time.

Strings are what make a long history big in memory (a 900,000-row history holds ~100 MB of
layer, signal, metric... values but 7 MB of values). So each row group is reduced as it
streams: its rows become ``(key, sample_id, value)`` with ``key`` an integer id of the (tensor,
metric) group, and per-group facts (latest shape, dtype, unavailable reasons) are folded into
small frames. result.json's aggregates are then Polars lazy aggregations over the compact frame.

Row groups arrive with their string columns dictionary-encoded (as read from the parts): rows
are grouped by dictionary index, and only the few group keys are decoded.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from ti_io.finish.index_md import HistoryFacts
from ti_io.read.aggregates import statistic_exprs, window_ranks
from ti_io.read.ordering import GROUP_KEYS

_KEYS: Final[list[str]] = list(GROUP_KEYS)
_UNAVAILABLE_LINES: Final[int] = 40
_NEEDED: Final[list[str]] = [*_KEYS, "sample_id", "value", "unavailable_reason", "timestamp"]


def _as_codes(table: pa.Table) -> tuple[pa.Table, dict[str, pa.Array]]:
    """``table`` with each dictionary column replaced by its indices into one dictionary per
    column (returned by name); other columns unchanged."""
    table = table.unify_dictionaries()
    dictionaries: dict[str, pa.Array] = {}
    columns: list[pa.ChunkedArray] = []
    for field, column in zip(table.schema, table.columns, strict=True):
        if pa.types.is_dictionary(field.type):
            # After unify_dictionaries every chunk holds the same dictionary. Grouping by index
            # needs one index per string: a dictionary with repeated values is decoded instead.
            dictionary = column.chunk(0).dictionary
            if len(pc.unique(dictionary)) == len(dictionary):
                dictionaries[field.name] = dictionary
                column = pa.chunked_array([c.indices for c in column.chunks], field.type.index_type)
            else:
                column = column.cast(field.type.value_type)
        columns.append(column)
    return pa.table(columns, names=table.column_names), dictionaries


def _decoded(frame: pl.DataFrame, dictionaries: dict[str, pa.Array]) -> pl.DataFrame:
    """``frame`` (a few rows) with its dictionary-index columns turned back into strings."""
    strings = [
        pl.Series(name, dictionary.take(frame.get_column(name).to_arrow()).cast(pa.string()))
        for name, dictionary in dictionaries.items()
        if name in frame.columns
    ]
    return frame.with_columns(strings)


class HistoryDigest:
    """Accumulates compact aggregation input and counts from ``ti.history`` row groups."""

    def __init__(self) -> None:
        self._catalog = pl.DataFrame(
            schema={
                "layer": pl.String,
                "call_index": pl.Int32,
                "signal": pl.String,
                "tensor_path": pl.String,
                "mode": pl.String,
                "grad_enabled": pl.Boolean,
                "metric": pl.String,
                "key": pl.UInt32,
            }
        )
        self._values: list[pl.DataFrame] = []
        self._samples: list[pl.Series] = []
        self._groups: list[pl.DataFrame] = []
        self._reasons: list[pl.DataFrame] = []
        self._first_time: datetime | None = None
        self._last_time: datetime | None = None
        self.rows = 0

    def add(self, part: pa.Table) -> None:
        """Fold one conforming ``ti.history`` table (string columns plain or
        dictionary-encoded) into the digest."""
        if part.num_rows == 0:
            return
        encoded, dictionaries = _as_codes(part.select(_NEEDED))
        frame = pl.from_arrow(encoded)
        assert isinstance(frame, pl.DataFrame)
        frame = frame.with_row_index("_row")
        latest = pl.col("sample_id").arg_max()
        groups = frame.group_by(_KEYS).agg(
            pl.len().alias("rows"),
            pl.col("value").null_count().alias("nulls"),
            pl.col("sample_id").max().alias("latest_sample"),
            pl.col("_row").get(latest).alias("_latest_row"),
            pl.col("_row").first().alias("_first_row"),
            pl.col("sample_id").alias("_sample_ids"),
            pl.col("value").alias("_values"),
        )
        groups = _decoded(groups, dictionaries)
        # Group ids: the row group's few groups are matched against the catalog (a small
        # join), rather than joining every row on seven key columns.
        known = groups.select(_KEYS).join(self._catalog, on=_KEYS, how="left")
        new = known.filter(pl.col("key").is_null()).select(_KEYS)
        if new.height:
            start = self._catalog.height
            new = new.with_columns(
                pl.int_range(start, start + new.height, dtype=pl.UInt32).alias("key")
            )
            self._catalog = pl.concat([self._catalog, new])
        groups = groups.join(self._catalog, on=_KEYS, how="left")
        self._values.append(
            groups.select("key", "_sample_ids", "_values")
            .explode(["_sample_ids", "_values"])
            .rename({"_sample_ids": "sample_id", "_values": "value"})
        )
        # Per-group facts from the group's newest row (shape, dtype) and first row (type).
        latest_rows = groups.get_column("_latest_row").to_arrow()
        first_rows = groups.get_column("_first_row").to_arrow()
        facts = pl.from_arrow(
            pa.table(
                {
                    "latest_shape": part.column("shape").take(latest_rows),
                    "dtype": part.column("dtype").take(latest_rows).cast(pa.string()),
                    "module_type": part.column("module_type").take(first_rows).cast(pa.string()),
                }
            )
        )
        assert isinstance(facts, pl.DataFrame)
        self._groups.append(
            pl.concat(
                [groups.select("rows", "nulls", "latest_sample"), facts, groups.select("key")],
                how="horizontal",
            )
        )
        missing = frame.filter(pl.col("value").is_null())
        if missing.height:
            reasons = missing.group_by([*_KEYS, "unavailable_reason"]).agg(pl.len().alias("rows"))
            self._reasons.append(
                _decoded(reasons, dictionaries)
                .join(self._catalog, on=_KEYS, how="left")
                .select("key", "unavailable_reason", "rows")
            )
        self._samples.append(frame.get_column("sample_id").unique())
        times = frame.select(
            pl.col("timestamp").min().alias("first"), pl.col("timestamp").max().alias("last")
        ).row(0)
        if self._first_time is None or times[0] < self._first_time:
            self._first_time = times[0]
        if self._last_time is None or times[1] > self._last_time:
            self._last_time = times[1]
        self.rows += part.num_rows

    def _group_facts(self) -> pl.DataFrame:
        groups = pl.concat(self._groups) if self._groups else None
        if groups is None:
            return pl.DataFrame()
        newest = pl.col("latest_sample").arg_max()
        return groups.group_by("key").agg(
            pl.col("latest_shape").get(newest),
            pl.col("dtype").get(newest),
            pl.col("module_type").first(),
        )

    def _reason_facts(self) -> pl.DataFrame:
        if not self._reasons:
            return pl.DataFrame(
                schema={"key": pl.UInt32, "unavailable_reason": pl.String, "rows": pl.UInt32}
            )
        return (
            pl.concat(self._reasons).group_by("key", "unavailable_reason").agg(pl.col("rows").sum())
        )

    def aggregated(self, window: int) -> pl.DataFrame:
        """One row per (tensor, metric): the columns ``result_json.build_records`` reads."""
        if not self._values:
            return pl.DataFrame()
        stats = (
            pl.concat(self._values)
            .lazy()
            .with_columns(window_ranks(["key"]))
            .group_by("key")
            .agg(*statistic_exprs(window))
        )
        reasons = (
            self._reason_facts()
            .lazy()
            .sort("rows", "unavailable_reason", descending=[True, False])
            .group_by("key", maintain_order=True)
            .agg(
                pl.col("unavailable_reason").first().alias("first_reason"),
                pl.len().alias("reasons"),
            )
        )
        return (
            stats.join(self._group_facts().lazy(), on="key", how="left")
            .join(reasons, on="key", how="left")
            .join(self._catalog.lazy(), on="key", how="left")
            .with_columns(pl.col("reasons").fill_null(0))
            .collect()
        )

    def facts(self, histogram_rows: int | None) -> HistoryFacts:
        """Counts for index.md."""
        if not self._values:
            return HistoryFacts(histograms=histogram_rows)
        groups = pl.concat(self._groups)
        per_key = groups.group_by("key").agg(pl.col("rows").sum(), pl.col("nulls").sum())
        per_layer = (
            per_key.join(self._catalog, on="key")
            .group_by("layer")
            .agg(pl.col("rows").sum(), pl.col("nulls").sum())
        )
        missing = (
            self._reason_facts()
            .join(self._catalog, on="key")
            .sort(["rows", "layer", "signal", "metric"], descending=[True, False, False, False])
            .head(_UNAVAILABLE_LINES)
        )
        sample_ids = pl.concat(self._samples)
        return HistoryFacts(
            rows=self.rows,
            samples=sample_ids.n_unique(),
            first_sample=sample_ids.min(),  # type: ignore[arg-type]
            last_sample=sample_ids.max(),  # type: ignore[arg-type]
            first_time=self._first_time,
            last_time=self._last_time,
            layer_rows={
                r["layer"]: (int(r["rows"]), int(r["nulls"]))
                for r in per_layer.iter_rows(named=True)
            },
            unavailable=[
                (
                    r["layer"],
                    r["signal"],
                    r["metric"],
                    r["unavailable_reason"] or "",
                    int(r["rows"]),
                )
                for r in missing.iter_rows(named=True)
            ],
            unavailable_total=int(per_key.get_column("nulls").sum()),
            histograms=histogram_rows,
        )
