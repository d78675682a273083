"""The ti contract through Polars: what survives a round trip, and how to keep it whole.

Findings (Polars 2.x, pinned by these tests): Polars keeps column names, types (as
large_string/string_view and large_list) and values, but neither Arrow nullability nor schema
metadata on its frames; the `ti` key stays readable from the Parquet footer
(`pl.read_parquet_metadata`). `df.write_parquet(path)` writes a file without `ti` whose columns are
all nullable; `**ti_schema.polars_write_options(schema)` writes a conforming one.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import ti_core
import ti_io  # noqa: F401  (the real run below writes through ti-io)
import ti_schema
from ti_schema import SchemaMismatchError, validate_histograms, validate_history
from ti_schema.testing import (
    assert_artifact_dir_conforms,
    example_histogram_table,
    example_history_table,
)


def assert_same_rows(got: pa.Table | pl.DataFrame, want: pa.Table) -> None:
    """Every row and column, values included (string flavours aside: Python values compare)."""
    table = got.to_arrow() if isinstance(got, pl.DataFrame) else got
    assert want.num_rows > 0
    assert table.column_names == want.column_names
    assert table.to_pylist() == want.to_pylist()


@pytest.fixture
def history_file(tmp_path: Path) -> Path:
    path = tmp_path / "history.parquet"
    pq.write_table(example_history_table(120, producer="ti-core 0.1.0"), path)
    return path


def test_pyarrow_file_keeps_ti_in_the_footer_polars_reads(history_file: Path) -> None:
    footer = pl.read_parquet_metadata(history_file)
    doc = ti_schema.parse_metadata(footer)
    version = ti_schema.SCHEMA_VERSION
    assert doc == {"schema": "ti.history", "schema_version": version, "producer": "ti-core 0.1.0"}
    assert ti_schema.check_compatible(footer) == ti_schema.parse_version(version)


@pytest.mark.parametrize("compat", ["oldest", "newest"])
def test_polars_read_back_validates_with_the_footer_metadata(
    history_file: Path, compat: str
) -> None:
    level = getattr(pl.CompatLevel, compat)()
    arrow = pl.read_parquet(history_file).to_arrow(compat_level=level)
    # The frame alone lost the metadata and the nullability flags: that is reported, not hidden.
    with pytest.raises(SchemaMismatchError) as info:
        validate_history(arrow)
    assert info.value.kinds == {"missing_metadata", "nullability"}
    footer = pl.read_parquet_metadata(history_file)
    validate_history(arrow, metadata=footer, nullability="data")
    assert arrow.equals(pq.read_table(history_file).cast(arrow.schema))


def test_polars_scan_validates_and_keeps_values(history_file: Path) -> None:
    lazy = pl.scan_parquet(history_file)
    arrow = lazy.collect().to_arrow()
    validate_history(arrow, metadata=pl.read_parquet_metadata(history_file), nullability="data")
    assert_same_rows(arrow, pq.read_table(history_file))
    unavailable = lazy.filter(pl.col("value").is_null()).collect()
    assert unavailable.height > 0
    assert unavailable["unavailable_reason"].null_count() == 0


def test_polars_frame_is_accepted_directly_through_the_arrow_stream(history_file: Path) -> None:
    frame = pl.read_parquet(history_file)
    validate_history(frame, metadata=pl.read_parquet_metadata(history_file), nullability="data")


def test_dictionary_encoded_file_reads_back_through_polars(tmp_path: Path) -> None:
    path = tmp_path / "history.parquet"
    pq.write_table(example_history_table(dictionary=True), path)
    arrow = pl.read_parquet(path).to_arrow()
    validate_history(arrow, metadata=pl.read_parquet_metadata(path), nullability="data")
    assert_same_rows(arrow, example_history_table(dictionary=True))


def test_plain_polars_write_drops_metadata_and_nullability(
    history_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "polars.parquet"
    pl.read_parquet(history_file).write_parquet(out)
    assert b"ti" not in (pq.read_metadata(out).metadata or {})
    with pytest.raises(SchemaMismatchError) as info:
        validate_history(pq.read_table(out))
    assert info.value.kinds == {"missing_metadata", "nullability"}
    not_null = [f.name for f in ti_schema.history_schema() if not f.nullable]
    nullability = {m.where for m in info.value.mismatches if m.kind == "nullability"}
    assert nullability == {f"column {name!r}" for name in not_null}


@pytest.mark.parametrize("lazy", [False, True])
def test_polars_write_with_the_contract_options_conforms(
    history_file: Path, tmp_path: Path, lazy: bool
) -> None:
    out = tmp_path / "polars.parquet"
    options = ti_schema.polars_write_options(ti_schema.history_schema("ti-io 0.1.0"))
    if lazy:
        pl.scan_parquet(history_file).sink_parquet(out, **options)
    else:
        pl.read_parquet(history_file).write_parquet(out, **options)
    footer = pq.read_metadata(out).metadata
    assert ti_schema.parse_metadata(footer)["producer"] == "ti-io 0.1.0"
    # Polars puts `ti` in the footer but not in the Arrow schema pyarrow rebuilds from it.
    assert b"ti" not in (pq.read_schema(out).metadata or {})
    table = pq.read_table(out)
    assert not table.schema.field("layer").nullable
    validate_history(table, metadata=footer)
    validate_history(pl.read_parquet(out), metadata=footer, nullability="data")
    assert_same_rows(table, pq.read_table(history_file))


def test_histograms_round_trip_through_polars(tmp_path: Path) -> None:
    source = tmp_path / "histograms.parquet"
    table = example_histogram_table(10)
    pq.write_table(table, source)
    arrow = pl.read_parquet(source).to_arrow()
    validate_histograms(arrow, metadata=pl.read_parquet_metadata(source), nullability="data")
    assert_same_rows(arrow, table)
    out = tmp_path / "polars.parquet"
    pl.read_parquet(source).write_parquet(out, **ti_schema.polars_write_options(table.schema))
    validate_histograms(pq.read_table(out), metadata=pq.read_metadata(out).metadata)
    assert_same_rows(pq.read_table(out), table)


def test_cross_rank_scan_is_a_valid_table(tmp_path: Path) -> None:
    stats = tmp_path / "stats"
    for rank in (0, 1):
        directory = stats / f"rank-{rank:03d}"
        directory.mkdir(parents=True)
        table = example_history_table(45)
        ranks = pa.array([rank] * table.num_rows, pa.int32())
        table = table.set_column(1, table.schema.field("rank"), ranks)
        pq.write_table(table, directory / "history.parquet")
    lazy = pl.scan_parquet(str(stats / "rank-*" / "history.parquet"))
    combined = lazy.collect()
    assert sorted(combined["rank"].unique().to_list()) == [0, 1]
    footer = pl.read_parquet_metadata(stats / "rank-000" / "history.parquet")
    validate_history(combined.to_arrow(), metadata=footer, nullability="data")
    written = pa.concat_tables(
        pq.read_table(stats / f"rank-{rank:03d}" / "history.parquet") for rank in (0, 1)
    )
    assert_same_rows(combined.sort("rank", maintain_order=True), written)


def test_artifact_dir_written_by_polars_conforms(history_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "stats"
    run.mkdir()
    options = ti_schema.polars_write_options(ti_schema.history_schema("ti-io 0.1.0"))
    pl.read_parquet(history_file).write_parquet(run / "history.parquet", **options)
    (run / "result.json").write_text("[]")
    (run / "index.md").write_text("# run\n")
    assert_artifact_dir_conforms(run)
    pl.read_parquet(history_file).write_parquet(run / "history.parquet")
    with pytest.raises(AssertionError, match="no 'ti' key"):
        assert_artifact_dir_conforms(run)


def test_a_real_run_conforms_and_reads_back_through_polars(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    stats = tmp_path / "stats"
    ti_core.inject_observer(model, output_dir=stats, sampler=ti_core.AlwaysSampler())
    try:
        for _ in range(3):
            model(torch.randn(5, 4)).sum().backward()
        model(torch.empty(0, 4))  # an empty batch: unavailable rows with reasons
    finally:
        ti_core.remove_observer(model)
    assert_artifact_dir_conforms(stats)
    path = stats / "history.parquet"
    frame = pl.read_parquet(path)
    validate_history(frame, metadata=pl.read_parquet_metadata(path), nullability="data")
    assert ti_schema.parse_metadata(pl.read_parquet_metadata(path))["producer"].startswith("ti-")
    unavailable = frame.filter(pl.col("value").is_null())
    assert unavailable.height > 0
    assert unavailable["unavailable_reason"].null_count() == 0
