"""ti_schema.testing: the conformance kit third-party producers and sinks run on their output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ti_schema import SchemaMismatchError, validate_history
from ti_schema.artifacts import artifact_dir_problems
from ti_schema.layout import JOURNAL_FILE, part_name
from ti_schema.testing import (
    assert_artifact_dir_conforms,
    assert_histograms_conform,
    assert_history_conforms,
    assert_result_json_conforms,
    example_histogram_table,
    example_history_table,
    load_strict_json,
)

RESULT = [
    {
        "layer": "head",
        "type": "Linear",
        "aliases": [],
        "tensors": [
            {
                "call_index": 0,
                "signal": "output",
                "tensor_path": "",
                "mode": "eval",
                "grad_enabled": False,
                "latest_shape": [4, 2],
                "dtype": "bfloat16",
                "statistics": {
                    "mean": {
                        "observations": 1,
                        "unavailable": 0,
                        "mean": 0.5,
                        "std": 0.0,
                        "min": 0.5,
                        "p25": 0.5,
                        "p50": 0.5,
                        "p75": 0.5,
                        "max": 0.5,
                        "previous_window_mean": None,
                        "recent_window_mean": 0.5,
                        "unavailable_reason": "one window only",
                    }
                },
            }
        ],
    }
]


def with_rank(table: pa.Table, rank: int) -> pa.Table:
    index = table.column_names.index("rank")
    return table.set_column(
        index, table.schema.field(index), pa.array([rank] * table.num_rows, pa.int32())
    )


def write_run(directory: Path, *, rank: int = 0, histograms: pa.Table | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(with_rank(example_history_table(), rank), directory / "history.parquet")
    if histograms is not None:
        pq.write_table(histograms, directory / "histograms.parquet")
    (directory / "result.json").write_text(json.dumps(RESULT, allow_nan=False))
    (directory / "index.md").write_text("# run\n")
    return directory


def test_table_assertions_pass_on_conforming_tables() -> None:
    assert_history_conforms(example_history_table())
    assert_history_conforms(example_history_table(dictionary=True).to_batches()[0])
    assert_histograms_conform(example_histogram_table())


def test_table_assertions_raise_assertion_errors_chaining_the_mismatch() -> None:
    with pytest.raises(AssertionError, match="column 'metric': is missing") as info:
        assert_history_conforms(example_history_table().drop_columns(["metric"]))
    assert isinstance(info.value.__cause__, SchemaMismatchError)
    with pytest.raises(AssertionError, match=r"describes schema 'ti\.history'"):
        assert_histograms_conform(example_history_table())


def test_nullability_data_mode_is_available_to_sinks_on_engines_without_the_flag() -> None:
    table = example_history_table()
    loose = table.cast(
        pa.schema([f.with_nullable(True) for f in table.schema], table.schema.metadata)
    )
    with pytest.raises(AssertionError, match="declared nullable"):
        assert_history_conforms(loose)
    assert_history_conforms(loose, nullability="data")


@pytest.mark.parametrize("rows", [0, 1, 9, 10, 500])
def test_example_history_table_is_valid_at_any_size(rows: int) -> None:
    table = example_history_table(rows)
    assert table.num_rows == rows
    validate_history(table)
    assert table.equals(example_history_table(rows))


def test_example_history_table_covers_unavailable_rows_and_both_signals() -> None:
    table = example_history_table(200)
    reasons = set(table.column("unavailable_reason").to_pylist())
    assert reasons == {None, "empty tensor"}
    assert set(table.column("signal").to_pylist()) == {"output", "output_gradient"}
    assert table.column("metric").to_pylist()[:9] == [
        "mean", "std", "min", "max", "p25", "p50", "p75", "zero_fraction", "nonfinite_fraction"
    ]  # fmt: skip


def test_example_tables_refuse_negative_sizes() -> None:
    with pytest.raises(ValueError, match="rows must be >= 0"):
        example_history_table(-1)
    with pytest.raises(ValueError, match="rows must be >= 0"):
        example_histogram_table(-1)


def test_result_json_assertion_reads_files_strictly(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    path.write_text(json.dumps(RESULT))
    assert_result_json_conforms(path)
    assert_result_json_conforms(str(path))
    assert_result_json_conforms(RESULT)
    path.write_text(json.dumps(RESULT).replace("0.5", "NaN", 1))
    with pytest.raises(AssertionError, match="NaN is not strict JSON"):
        assert_result_json_conforms(path)
    path.write_text("[Infinity]")
    with pytest.raises(ValueError, match="Infinity is not strict JSON"):
        load_strict_json(path)
    with pytest.raises(AssertionError, match="cannot be read"):
        assert_result_json_conforms(tmp_path / "absent.json")
    with pytest.raises(AssertionError, match=r"\$\[0\]\.type: is missing"):
        assert_result_json_conforms([{"layer": "x", "aliases": [], "tensors": []}])


def test_artifact_dir_of_one_run(tmp_path: Path) -> None:
    run = write_run(tmp_path / "stats", histograms=example_histogram_table())
    assert_artifact_dir_conforms(run)
    (run / "index.md").unlink()
    (run / "result.json").write_text("[{}]")
    with pytest.raises(AssertionError) as info:
        assert_artifact_dir_conforms(run)
    text = str(info.value)
    assert "index.md: missing" in text
    assert "result.json: $[0].layer: is missing" in text


def test_artifact_dir_reports_bad_parquet_files(tmp_path: Path) -> None:
    bad_histograms = example_histogram_table().drop_columns(["num"])
    run = write_run(tmp_path / "stats", histograms=bad_histograms)
    with pytest.raises(AssertionError, match=r"histograms.parquet: column 'num': is missing"):
        assert_artifact_dir_conforms(run)
    (run / "history.parquet").write_bytes(b"not parquet")
    with pytest.raises(AssertionError, match="cannot be read as Parquet"):
        assert_artifact_dir_conforms(run)


def test_artifact_dir_of_an_unconsolidated_run(tmp_path: Path) -> None:
    run = write_run(tmp_path / "stats")
    (run / "history.parquet").unlink()
    (run / "history.parts").mkdir()
    with pytest.raises(AssertionError, match="was not consolidated"):
        assert_artifact_dir_conforms(run)


def test_artifact_dir_with_rank_private_runs(tmp_path: Path) -> None:
    stats = tmp_path / "stats"
    for rank in (0, 1, 2):
        write_run(stats / f"rank-{rank:03d}", rank=rank)
    assert_artifact_dir_conforms(stats)
    pq.write_table(with_rank(example_history_table(), 0), stats / "rank-002" / "history.parquet")
    (stats / "rank-001" / "result.json").unlink()
    with pytest.raises(AssertionError) as info:
        assert_artifact_dir_conforms(stats)
    text = str(info.value)
    assert "2 problems" in text
    assert "sits in rank-002/ but holds rank values [0]" in text
    assert "rank-001/result.json: missing" in text


def test_live_runs_conform_only_when_allowed_and_their_parts_are_checked(tmp_path: Path) -> None:
    run = write_run(tmp_path / "stats")
    (run / "history.parquet").unlink()
    parts = run / "history.parts"
    parts.mkdir()
    assert_artifact_dir_conforms(run, allow_live=True)  # live, no part published yet
    pq.write_table(example_history_table(), parts / part_name(0))
    (run / "histograms.parts").mkdir()
    pq.write_table(example_histogram_table(), run / "histograms.parts" / part_name(0))
    (parts / ".part-000001.parquet.123.ti-tmp").write_bytes(b"in flight")  # not a part
    assert_artifact_dir_conforms(run, allow_live=True)
    with pytest.raises(AssertionError, match="was not consolidated"):
        assert_artifact_dir_conforms(run)
    pq.write_table(example_history_table().drop_columns(["value"]), parts / part_name(1))
    with pytest.raises(AssertionError) as info:
        assert_artifact_dir_conforms(run, allow_live=True)
    assert f"{parts / part_name(1)}: column 'value': is missing" in str(info.value)
    assert "1 problems" in str(info.value)


def test_an_unfinished_finalization_conforms_only_when_allowed(tmp_path: Path) -> None:
    # The finalization journal (layout.JOURNAL_FILE) says a finalization did not finish: the
    # files written so far and the parts left are checked; a finished run must not hold it.
    run = write_run(tmp_path / "stats")
    (run / "histograms.parts").mkdir()
    pq.write_table(example_histogram_table(), run / "histograms.parts" / part_name(0))
    (run / JOURNAL_FILE).write_text('{"state": "written"}')
    assert_artifact_dir_conforms(run, allow_live=True)
    (problem,) = artifact_dir_problems(run)
    assert problem.path == run / "finalization.json"
    assert "did not finish" in problem.message
    assert "ti consolidate" in problem.message
    pq.write_table(example_history_table().drop_columns(["value"]), run / "history.parquet")
    problems = [str(p) for p in artifact_dir_problems(run, allow_live=True)]
    assert problems == [f"{run / 'history.parquet'}: column 'value': is missing (expected double)"]


def test_parts_of_a_rank_directory_carry_its_rank(tmp_path: Path) -> None:
    rank = write_run(tmp_path / "stats" / "rank-004", rank=4)
    (rank / "history.parts").mkdir()
    pq.write_table(with_rank(example_history_table(), 4), rank / "history.parts" / part_name(0))
    assert artifact_dir_problems(tmp_path / "stats") == []
    pq.write_table(with_rank(example_history_table(), 5), rank / "history.parts" / part_name(1))
    (problem,) = artifact_dir_problems(tmp_path / "stats")
    assert problem.path == rank / "history.parts" / part_name(1)
    assert problem.message == "sits in rank-004/ but holds rank values [5]"


def test_files_are_checked_with_their_footer_metadata(tmp_path: Path) -> None:
    # As Polars writes it (polars_write_options): the stored Arrow schema has no `ti` key, the
    # Parquet footer has it. pyarrow's table then lacks it; the checker reads the footer.
    run = write_run(tmp_path / "stats")
    table = example_history_table()

    def write(metadata: dict[bytes, bytes] | None) -> None:
        with pq.ParquetWriter(run / "history.parquet", table.schema.remove_metadata()) as writer:
            writer.write_table(table.replace_schema_metadata(None))
            if metadata:
                writer.add_key_value_metadata(metadata)

    write(None)
    problems = [str(p) for p in artifact_dir_problems(run)]
    assert any("no 'ti' key" in p for p in problems), problems
    write(table.schema.metadata)
    assert not (pq.read_table(run / "history.parquet").schema.metadata or {}).get(b"ti")
    assert artifact_dir_problems(run) == []


def test_artifact_dir_must_exist(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="is not a directory"):
        assert_artifact_dir_conforms(tmp_path / "nothing")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        artifact_dir_problems(tmp_path / "nothing")


def test_histogram_example_is_internally_consistent() -> None:
    table: Any = example_histogram_table(12, dictionary=True)
    assert_histograms_conform(table)
    sums = [sum(c) for c in table.column("bucket_counts").to_pylist()]
    assert sums == table.column("num").to_pylist()
