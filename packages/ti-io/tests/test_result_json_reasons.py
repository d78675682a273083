"""result.json's null rules and the reasons it gives (docs/artifacts.md, "result.json"):
``finish_statistics`` on hand-built aggregates, one rule per row, the texts as documented."""

from __future__ import annotations

import math
from typing import Any

import polars as pl

from ti_io.finish.statistics import finish_statistics
from ti_io.read.aggregates import AGGREGATES

WINDOW = 20
ALL_OTHERS = " other reasons; see unavailable_reason in history.parquet)"


def _row(observations: int, unavailable: int = 0, **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(AGGREGATES, 1.5)
    row.update(observations=observations, unavailable=unavailable)
    row.update(first_reason=None, reasons=0)
    row.update(values)
    return row


def _finish(*rows: dict[str, Any]) -> list[dict[str, Any]]:
    frame = pl.DataFrame(
        list(rows),
        schema={
            **dict.fromkeys(AGGREGATES, pl.Float64),
            "observations": pl.Int64,
            "unavailable": pl.Int64,
            "first_reason": pl.String,
            "reasons": pl.Int64,
        },
    )
    return finish_statistics(frame, WINDOW).to_dicts()


def test_a_statistic_without_observations_names_its_reasons() -> None:
    reason = "empty tensor (numel=0)"
    rows = _finish(
        *(
            _row(0, unavailable=12, first_reason=reason, reasons=n, mean=None, std=None)
            for n in (1, 2, 3, 4)
        )
    )
    assert [r["unavailable_reason"] for r in rows] == [
        "all 12 samples unavailable: empty tensor (numel=0)",
        "all 12 samples unavailable: empty tensor (numel=0)"
        " (and 1 other reason; see unavailable_reason in history.parquet)",
        "all 12 samples unavailable: empty tensor (numel=0) (and 2" + ALL_OTHERS,
        "all 12 samples unavailable: empty tensor (numel=0) (and 3" + ALL_OTHERS,
    ]
    for row in rows:  # no observation: every aggregate is null, even a stray number
        assert all(row[key] is None for key in AGGREGATES)


def test_an_empty_previous_window_is_null_with_its_reason() -> None:
    one, at_window, past = _finish(_row(1), _row(WINDOW), _row(WINDOW + 1))
    assert one["unavailable_reason"] == (
        "previous_window_mean has no observations: all 1 are in the recent window of 20"
    )
    assert at_window["unavailable_reason"] == (
        "previous_window_mean has no observations: all 20 are in the recent window of 20"
    )
    assert past["unavailable_reason"] is None
    # One observation is enough for every other aggregate.
    assert all(one[key] == 1.5 for key in AGGREGATES if key != "previous_window_mean")
    assert all(past[key] == 1.5 for key in AGGREGATES)


def test_non_finite_aggregates_are_null_and_named() -> None:
    (nonfinite,) = _finish(_row(WINDOW + 5, mean=math.nan, std=math.inf))
    assert nonfinite["mean"] is None
    assert nonfinite["std"] is None
    assert nonfinite["unavailable_reason"] == (
        "mean, std not finite: the observations include NaN or infinity"
    )
    (both,) = _finish(_row(3, min=-math.inf))
    assert both["unavailable_reason"] == (
        "previous_window_mean has no observations: all 3 are in the recent window of 20; "
        "min not finite: the observations include NaN or infinity"
    )
    assert both["min"] is None
