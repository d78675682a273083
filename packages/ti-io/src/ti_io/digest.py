"""What finalization learns from the history while streaming it, part by part.

Strings are what make a long history big in memory (a 900,000-row history holds ~100 MB of
layer, signal, metric... values but 7 MB of values). So each part is reduced as it streams:
its rows become ``(key, sample_id, value)`` with ``key`` an integer id of the (tensor, metric)
group, and per-group facts (latest shape, dtype, unavailable reasons) are folded into small
frames. result.json's aggregates are then Polars lazy aggregations over the compact frame.
"""

from __future__ import annotations

from typing import Final

import polars as pl
import pyarrow as pa

from ti_io.index_md import HistoryFacts
from ti_io.result_json import GROUP_KEYS, statistic_exprs, window_ranks

_KEYS: Final[list[str]] = list(GROUP_KEYS)
_UNAVAILABLE_LINES: Final[int] = 40
_NEEDED: Final[list[str]] = [
    *_KEYS,
    "sample_id",
    "value",
    "unavailable_reason",
    "shape",
    "dtype",
    "module_type",
    "timestamp",
]


class HistoryDigest:
    """Accumulates compact aggregation input and counts from ``ti.history`` parts."""

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
        self._groups: list[pl.DataFrame] = []
        self._reasons: list[pl.DataFrame] = []
        self.rows = 0

    def add(self, part: pa.Table) -> None:
        """Fold one part (a conforming ``ti.history`` table) into the digest."""
        if part.num_rows == 0:
            return
        frame = pl.from_arrow(part.select(_NEEDED))
        assert isinstance(frame, pl.DataFrame)
        latest = pl.col("sample_id").arg_max()
        groups = frame.group_by(_KEYS).agg(
            pl.len().alias("rows"),
            pl.col("value").null_count().alias("nulls"),
            pl.col("sample_id").max().alias("latest_sample"),
            pl.col("shape").get(latest).alias("latest_shape"),
            pl.col("dtype").get(latest).alias("dtype"),
            pl.col("module_type").first().alias("module_type"),
            pl.col("timestamp").min().alias("first_time"),
            pl.col("timestamp").max().alias("last_time"),
            pl.col("sample_id").alias("_sample_ids"),
            pl.col("value").alias("_values"),
        )
        # Group ids: the part's few groups are matched against the catalog (a small join),
        # rather than joining every row on seven key columns.
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
        self._groups.append(groups.drop([*_KEYS, "_sample_ids", "_values"]))
        missing = frame.filter(pl.col("value").is_null())
        if missing.height:
            self._reasons.append(
                missing.join(self._catalog, on=_KEYS, how="left")
                .group_by("key", "unavailable_reason")
                .agg(pl.len().alias("rows"))
            )
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
        values = pl.concat(self._values)
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
        sample_ids = values.get_column("sample_id")
        return HistoryFacts(
            rows=self.rows,
            samples=sample_ids.n_unique(),
            first_sample=sample_ids.min(),  # type: ignore[arg-type]
            last_sample=sample_ids.max(),  # type: ignore[arg-type]
            first_time=groups.get_column("first_time").min(),  # type: ignore[arg-type]
            last_time=groups.get_column("last_time").max(),  # type: ignore[arg-type]
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
