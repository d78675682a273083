"""Shared helpers: ``ti.history`` rows written to real Parquet files with pyarrow."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ti_schema import history_schema

HistoryRow = dict[str, object]


def history_rows(
    rank: int,
    values: Sequence[float | None],
    *,
    layer: str = "fc",
    metric: str = "mean",
    signal: str = "output",
    run_id: str | None = None,
    first_sample: int = 0,
) -> list[HistoryRow]:
    """One row per sample for one rank: sample ``first_sample + i`` has ``values[i]``."""
    rows: list[HistoryRow] = []
    for i, value in enumerate(values):
        sample = first_sample + i
        rows.append(
            {
                "run_id": run_id or f"run-{rank}",
                "rank": rank,
                "sample_id": sample,
                "forward_index": 10 * sample,
                "timestamp": datetime(2026, 1, 1, 0, 0, sample, tzinfo=UTC),
                "layer": layer,
                "module_type": "Linear",
                "call_index": 0,
                "signal": signal,
                "tensor_path": "",
                "mode": "train",
                "grad_enabled": True,
                "shape": [4, 3],
                "dtype": "float32",
                "metric": metric,
                "value": value,
                "unavailable_reason": None if value is not None else "no finite entries",
            }
        )
    return rows


def write_history(path: Path, rows: Sequence[HistoryRow], *, dictionary: bool = False) -> pa.Table:
    """Write ``rows`` to ``path`` as ``ti.history`` Parquet (optionally dictionary-encoded)."""
    table = pa.Table.from_pylist(list(rows), schema=history_schema("ti-dist-tests 0"))
    if dictionary:
        columns = [
            col.dictionary_encode() if name in ("layer", "metric", "signal") else col
            for name, col in zip(table.column_names, table.columns, strict=True)
        ]
        table = pa.table(columns, names=table.column_names)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return table


# Session scope: they hand out plain functions, so module-scoped fixtures can use them too.
@pytest.fixture(scope="session")
def rows_for() -> Callable[..., list[HistoryRow]]:
    return history_rows


@pytest.fixture(scope="session")
def write() -> Callable[..., pa.Table]:
    return write_history
