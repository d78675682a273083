"""scan_ranks over real Parquet files laid out as ranks, live parts and plain runs."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from ti_dist import collect_streaming, find_history_sources, scan_ranks
from ti_schema.layout import part_name

Write = Callable[..., pa.Table]
Rows = Callable[..., list[dict[str, object]]]


def test_final_files_and_live_parts_together(tmp_path: Path, write: Write, rows_for: Rows) -> None:
    write(tmp_path / "rank-000" / "history.parquet", rows_for(0, [1.0, 2.0, 3.0]))
    # A rank killed before consolidation: only completed parts, plus an in-flight temporary.
    write(tmp_path / "rank-001" / "history.parts" / part_name(0), rows_for(1, [4.0]))
    write(
        tmp_path / "rank-001" / "history.parts" / part_name(1),
        rows_for(1, [5.0], first_sample=1),
    )
    write(tmp_path / "rank-001" / "history.parts" / ".part-000002.parquet.tmp", rows_for(1, [9.0]))
    write(tmp_path / "rank-001" / "history.parts" / ".part-000003.parquet", rows_for(1, [9.0]))
    # Parts left next to a final file are not read twice.
    write(tmp_path / "rank-000" / "history.parts" / part_name(0), rows_for(0, [9.0]))
    (tmp_path / "rank-002").mkdir()  # a rank that wrote nothing yet
    (tmp_path / "rank-x").mkdir()
    (tmp_path / "notes-rank-003").mkdir()

    frame = scan_ranks(tmp_path)
    assert isinstance(frame, pl.LazyFrame)
    table = frame.sort("rank", "sample_id").collect()
    assert table["rank"].to_list() == [0, 0, 0, 1, 1]
    assert table["value"].to_list() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert table.schema["rank"] == pl.Int32
    assert table.schema["value"] == pl.Float64

    sources = find_history_sources(tmp_path)
    assert [(s.rank, s.final, len(s.files)) for s in sources] == [(0, True, 1), (1, False, 2)]


def test_never_averages_across_ranks(tmp_path: Path, write: Write, rows_for: Rows) -> None:
    rng = np.random.default_rng(0)
    expected: dict[int, np.ndarray] = {}
    for rank in range(4):
        values = rng.normal(loc=rank, size=6)
        expected[rank] = values
        write(tmp_path / f"rank-{rank:03d}" / "history.parquet", rows_for(rank, values.tolist()))
    got = (
        scan_ranks(tmp_path)
        .group_by("rank")
        .agg(pl.len().alias("rows"), pl.col("value").mean().alias("mean"))
        .sort("rank")
        .collect()
    )
    assert got["rows"].to_list() == [6, 6, 6, 6]
    np.testing.assert_allclose(
        got["mean"].to_numpy(), [expected[r].mean(dtype=np.float64) for r in range(4)], rtol=1e-12
    )


def test_plain_single_directory_run(tmp_path: Path, write: Write, rows_for: Rows) -> None:
    write(tmp_path / "history.parquet", rows_for(0, [1.5, 2.5]))
    table = scan_ranks(str(tmp_path)).collect()
    assert table["value"].to_list() == [1.5, 2.5]
    assert set(table["rank"].to_list()) == {0}


def test_plain_live_run_reads_parts(tmp_path: Path, write: Write, rows_for: Rows) -> None:
    write(tmp_path / "history.parts" / part_name(0), rows_for(0, [7.0]))
    assert scan_ranks(tmp_path).collect()["value"].to_list() == [7.0]


def test_parts_are_read_in_part_order_and_only_parts(
    tmp_path: Path, write: Write, rows_for: Rows
) -> None:
    # The layout of ti_schema.layout: part numbers, not names, order the parts (a run past a
    # million parts has 7-digit names); other Parquet files in the folder are not parts.
    parts = tmp_path / "rank-003" / "history.parts"
    for index in (1_000_000, 2, 999_999):
        write(parts / part_name(index), rows_for(3, [float(index)]))
    write(parts / "notes.parquet", rows_for(3, [-1.0]))
    write(parts / "part-7.parquet", rows_for(3, [-2.0]))
    (source,) = find_history_sources(tmp_path)
    assert [p.name for p in source.files] == [
        "part-000002.parquet",
        "part-999999.parquet",
        "part-1000000.parquet",
    ]
    assert scan_ranks(tmp_path).collect()["value"].to_list() == [2.0, 999_999.0, 1_000_000.0]


def test_root_run_next_to_rank_dirs(tmp_path: Path, write: Write, rows_for: Rows) -> None:
    # A rank0 run and an all-ranks run in the same output_dir: both are read, run_id tells them
    # apart.
    write(tmp_path / "history.parquet", rows_for(0, [1.0], run_id="rank0-run"))
    write(tmp_path / "rank-001" / "history.parquet", rows_for(1, [2.0], run_id="all-run"))
    table = scan_ranks(tmp_path).sort("rank").collect()
    assert table.select("run_id", "rank", "value").rows() == [
        ("rank0-run", 0, 1.0),
        ("all-run", 1, 2.0),
    ]
    assert [s.rank for s in find_history_sources(tmp_path)] == [None, 1]


def test_dictionary_and_plain_strings_mix(tmp_path: Path, write: Write, rows_for: Rows) -> None:
    write(tmp_path / "rank-000" / "history.parquet", rows_for(0, [1.0]), dictionary=True)
    write(tmp_path / "rank-001" / "history.parquet", rows_for(1, [2.0]))
    table = scan_ranks(tmp_path).collect()
    assert table.schema["layer"] == pl.String
    assert table.schema["metric"] == pl.String
    assert table.filter(pl.col("layer") == "fc").height == 2


def test_streaming_collect_matches(tmp_path: Path, write: Write, rows_for: Rows) -> None:
    for rank in range(3):
        write(tmp_path / f"rank-{rank:03d}" / "history.parquet", rows_for(rank, [rank, rank + 1]))
    query = scan_ranks(tmp_path).group_by("rank").agg(pl.col("value").max()).sort("rank")
    assert collect_streaming(query)["value"].to_list() == [1.0, 2.0, 3.0]
    assert collect_streaming(query).equals(query.collect())


def test_nothing_found_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "rank-000").mkdir()
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"no history found under output_dir '{tmp_path}'")
    ):
        scan_ranks(tmp_path)


def test_missing_directory_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"output_dir '{missing}' is not a directory")
    ):
        scan_ranks(missing)
