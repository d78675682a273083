"""compare_ranks: values lined up across ranks, spread, and the documented stand-out rule."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from ti_dist import compare_ranks

Write = Callable[..., pa.Table]
Rows = Callable[..., list[dict[str, object]]]


def _frame(rows: list[dict[str, object]]) -> pl.DataFrame:
    from ti_schema import history_schema

    return pl.from_arrow(pa.Table.from_pylist(rows, schema=history_schema()))  # type: ignore[return-value]


def test_spread_and_outlier_against_numpy(tmp_path: Path, write: Write, rows_for: Rows) -> None:
    rng = np.random.default_rng(3)
    per_rank = {rank: rng.normal(1.0, 0.01, size=3) for rank in range(6)}
    per_rank[4][1] = 9.0  # one rank far from the others at sample 1
    for rank, values in per_rank.items():
        write(tmp_path / f"rank-{rank:03d}" / "history.parquet", rows_for(rank, values.tolist()))

    table = compare_ranks(tmp_path)
    assert table["sample_id"].to_list() == [0, 1, 2]
    for row in table.iter_rows(named=True):
        column = np.array([per_rank[r][row["sample_id"]] for r in range(6)], dtype=np.float64)
        assert row["n_ranks"] == 6
        assert row["ranks"] == list(range(6))
        np.testing.assert_allclose(row["values"], column, rtol=0, atol=0)
        assert row["min"] == column.min()
        assert row["max"] == column.max()
        assert row["spread"] == pytest.approx(column.max() - column.min(), rel=1e-15)
        assert row["median"] == pytest.approx(np.median(column), rel=1e-15)
        assert row["min_rank"] == int(column.argmin())
        assert row["max_rank"] == int(column.argmax())
        mad = np.median(np.abs(column - np.median(column)))
        expected = [r for r in range(6) if abs(column[r] - np.median(column)) > 5 * 1.4826 * mad]
        assert row["outlier_ranks"] == expected
        assert row["standout_ranks"] == expected
    assert table.filter(pl.col("sample_id") == 1)["standout_ranks"].to_list() == [[4]]
    assert table.filter(pl.col("sample_id") != 1)["standout_ranks"].to_list() == [[], []]

    only = compare_ranks(tmp_path, only_standouts=True)
    assert only["sample_id"].to_list() == [1]


def test_one_rank_with_nonfinite_values(rows_for: Rows) -> None:
    rows = []
    for rank in range(4):
        fraction = [0.0, 0.25 if rank == 2 else 0.0]
        rows += rows_for(rank, fraction, metric="nonfinite_fraction")
        rows += rows_for(rank, [1.0, None if rank == 2 else 1.0 + rank / 100], metric="mean")
        rows += rows_for(rank, [0.5, math.inf if rank == 2 else 0.5], metric="custom")
    table = compare_ranks(_frame(rows)).filter(pl.col("sample_id") == 1)
    by_metric = {row["metric"]: row for row in table.iter_rows(named=True)}

    frac = by_metric["nonfinite_fraction"]
    assert frac["standout_ranks"] == [2]
    assert frac["outlier_ranks"] == [2]  # MAD is 0: any difference from the median stands out
    assert frac["max"] == 0.25
    assert frac["max_rank"] == 2

    mean = by_metric["mean"]
    assert mean["unavailable_ranks"] == [2]
    assert mean["standout_ranks"] == [2]
    assert mean["n_ranks"] == 4
    assert mean["min"] == 1.0
    assert mean["max"] == 1.03
    assert mean["values"][2] is None

    custom = by_metric["custom"]
    assert custom["nonfinite_ranks"] == [2]
    assert custom["standout_ranks"] == [2]
    assert custom["max"] == 0.5  # min/max/spread cover the finite values only
    assert custom["spread"] == 0.0
    assert (custom["min_rank"], custom["max_rank"]) == (0, 0)  # ties name the lowest rank


def test_unavailable_everywhere_is_not_a_standout(rows_for: Rows) -> None:
    rows = [row for rank in range(3) for row in rows_for(rank, [None])]
    row = compare_ranks(_frame(rows)).row(0, named=True)
    assert row["unavailable_ranks"] == [0, 1, 2]
    assert row["standout_ranks"] == []
    assert row["min"] is None
    assert row["spread"] is None


def test_two_ranks_never_name_an_outlier(rows_for: Rows) -> None:
    rows = rows_for(0, [1.0]) + rows_for(1, [1000.0])
    row = compare_ranks(_frame(rows)).row(0, named=True)
    assert row["spread"] == 999.0
    assert row["standout_ranks"] == []


def test_tolerances_for_exact_agreement(rows_for: Rows) -> None:
    rows = [row for rank in range(3) for row in rows_for(rank, [2.0])]
    rows += rows_for(3, [2.0 + 1e-12])
    frame = _frame(rows)
    assert compare_ranks(frame).row(0, named=True)["standout_ranks"] == []
    assert compare_ranks(frame, rtol=0.0).row(0, named=True)["standout_ranks"] == [3]
    assert compare_ranks(frame, rtol=0.0, atol=1e-9).row(0, named=True)["standout_ranks"] == []


def test_filters_and_alignment(rows_for: Rows) -> None:
    rows = []
    for rank in range(3):
        rows += rows_for(rank, [1.0, 2.0], layer="a", metric="mean")
        rows += rows_for(rank, [3.0], layer="b", metric="std", signal="output_gradient")
    frame = _frame(rows).lazy()
    assert compare_ranks(frame, layer="a").height == 2
    assert compare_ranks(frame, layer=["a", "b"], metric="std").height == 1
    assert compare_ranks(frame, signal="output_gradient")["layer"].to_list() == ["b"]
    by_forward = compare_ranks(frame, layer="a", align_on="forward_index")
    assert by_forward["forward_index"].to_list() == [0, 10]
    assert "sample_id" not in by_forward.columns


def test_several_runs_of_one_rank_are_refused(rows_for: Rows) -> None:
    rows = rows_for(0, [1.0], run_id="first") + rows_for(0, [2.0], run_id="second")
    with pytest.raises(ValueError, match=r"rank 0 has 2 rows.*\['first', 'second'\].*run_id"):
        compare_ranks(_frame(rows))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"align_on": "step"}, ValueError, "align_on must be"),
        ({"threshold": -1.0}, ValueError, "threshold must be a number >= 0"),
        ({"rtol": math.nan}, ValueError, "rtol must be"),
        ({"layer": []}, TypeError, "layer must be a string or a non-empty sequence"),
        ({"metric": [1]}, TypeError, "metric must be"),
        ({"signal": "gradient"}, ValueError, r"signal must be one of .*\['gradient'\]"),
        ({"signal": ["output", "grad"]}, ValueError, r"signal must be one of .*\['grad'\]"),
    ],
)
def test_bad_arguments(
    rows_for: Rows, kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        compare_ranks(_frame(rows_for(0, [1.0])), **kwargs)  # type: ignore[arg-type]


def test_bad_source_type() -> None:
    with pytest.raises(TypeError, match="source must be an output_dir path"):
        compare_ranks(42)  # type: ignore[arg-type]
