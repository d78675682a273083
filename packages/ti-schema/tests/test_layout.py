"""The one on-disk layout: names, part order and rank directories (ti_schema.layout)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ti_schema import layout


def test_part_names_round_trip_and_sort_by_number() -> None:
    names = [layout.part_name(i) for i in (0, 42, 999_999, 1_000_000)]
    assert names == [
        "part-000000.parquet",
        "part-000042.parquet",
        "part-999999.parquet",
        "part-1000000.parquet",
    ]
    assert [layout.part_index(n) for n in names] == [0, 42, 999_999, 1_000_000]
    for stranger in ("part-42.parquet", ".part-000001.parquet.1-2-3.ti-tmp", "part-000001.pq"):
        assert layout.part_index(stranger) is None


def test_list_parts_orders_by_number_and_skips_what_is_not_a_part(tmp_path: Path) -> None:
    assert layout.list_parts(tmp_path / "missing") == []
    for index in (1_000_000, 7, 999_999, 0):
        (tmp_path / layout.part_name(index)).write_bytes(b"")
    (tmp_path / ".part-000008.parquet.1-2-3.ti-tmp").write_bytes(b"")
    (tmp_path / "notes.parquet").write_bytes(b"")
    (tmp_path / layout.RUN_FILE).write_text("{}")
    (tmp_path / layout.part_name(5)).mkdir()  # a directory is never a part
    assert [p.name for p in layout.list_parts(tmp_path)] == [
        "part-000000.parquet",
        "part-000007.parquet",
        "part-999999.parquet",
        "part-1000000.parquet",
    ]
    assert layout.list_parts(str(tmp_path)) == layout.list_parts(tmp_path)


def test_rank_directories(tmp_path: Path) -> None:
    assert [layout.rank_dir_name(r) for r in (0, 7, 1234)] == ["rank-000", "rank-007", "rank-1234"]
    assert [layout.rank_of_dir(n) for n in ("rank-003", "rank-1000", "rank-3", "rank-x")] == [
        3,
        1000,
        None,
        None,
    ]
    for name in ("rank-1000", "rank-002", "rank-010", "rank-x", "notes-rank-003"):
        (tmp_path / name).mkdir()
    (tmp_path / "rank-004").write_text("a file, not a rank's run")
    assert layout.list_rank_dirs(tmp_path) == [
        (2, tmp_path / "rank-002"),
        (10, tmp_path / "rank-010"),
        (1000, tmp_path / "rank-1000"),
    ]
    assert layout.list_rank_dirs(tmp_path / "missing") == []


@pytest.mark.parametrize("bad", [-1, 1.0, True, "3"])
def test_numbers_must_be_non_negative_ints(bad: object) -> None:
    with pytest.raises((TypeError, ValueError), match="part index must be"):
        layout.part_name(bad)  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError), match="rank must be"):
        layout.rank_dir_name(bad)  # type: ignore[arg-type]


def test_run_entries_name_every_file_and_directory_of_a_run() -> None:
    assert layout.RUN_ENTRIES == (
        "history.parquet",
        "histograms.parquet",
        "events.parquet",
        "result.json",
        "index.md",
        "finalization.json",
        "history.parts",
        "histograms.parts",
        "events.parts",
        "tensorboard",
    )
