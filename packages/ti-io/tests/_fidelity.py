"""Value fidelity checks: what a sink stored against the batches the test actually sent.

The expectations are built from the sent batches alone (``RecordBatch.to_pylist``, numpy float64
for aggregates), never from a file the sink wrote, so a sink that alters stored values (a scale
factor, a dropped or duplicated row, a swapped column) fails them. ``test_fidelity_detectors``
plants such defects in the real write path and proves each check catches them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HISTOGRAM_KEY = ("sample_id", "forward_index", "layer", "signal", "call_index", "tensor_path")
HISTORY_KEY = (*HISTOGRAM_KEY, "metric")
STATISTICS = ("mean", "std", "min", "p25", "p50", "p75", "max")


def _rows(batches: Iterable[pa.RecordBatch | pa.Table]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for batch in batches:
        rows += batch.to_pylist()  # dictionary-encoded strings come back as plain strings
    return rows


def _sorted(rows: list[dict[str, Any]], key: Sequence[str]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: tuple(r[k] for k in key))


def assert_rows_equal(
    stored: pa.Table, sent: Sequence[pa.RecordBatch], key: Sequence[str] = HISTORY_KEY
) -> None:
    """Every column of every row, ``value`` included, equals what was sent (order-free)."""
    got = _sorted(_rows([stored]), key)
    want = _sorted(_rows(sent), key)
    assert want, "vacuous check: nothing was sent"
    assert stored.schema.names == sent[0].schema.names
    assert len(got) == len(want), (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"row {i} differs: {_diff(g, w)}"


def assert_final_files_match(directory: Path, sent: Mapping[str, Sequence[pa.RecordBatch]]) -> None:
    """A finalized run's history.parquet and histograms.parquet hold exactly the ``"history"``
    and ``"histograms"`` batches that were sent."""
    assert_rows_equal(pq.read_table(directory / "history.parquet"), sent["history"])
    assert_rows_equal(
        pq.read_table(directory / "histograms.parquet"), sent["histograms"], HISTOGRAM_KEY
    )


def _diff(got: Mapping[str, Any], want: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {k: (got[k], want[k]) for k in want if got.get(k) != want[k]}


def reference_statistics(
    sent: Sequence[pa.RecordBatch], window: int
) -> dict[tuple[str, str, str], dict[str, Any]]:
    """result.json's per-(layer, signal, metric) aggregates computed with numpy float64 from the
    sent history batches, in sample order."""
    series: dict[tuple[str, str, str], list[tuple[int, float | None]]] = defaultdict(list)
    for row in _rows(sent):
        series[(row["layer"], row["signal"], row["metric"])].append(
            (row["sample_id"], row["value"])
        )
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for name, pairs in series.items():
        values = [v for _, v in sorted(pairs, key=lambda p: p[0])]
        observed = np.array([v for v in values if v is not None], dtype=np.float64)
        ref: dict[str, Any] = {
            "observations": len(observed),
            "unavailable": len(values) - len(observed),
        }
        if len(observed) == 0:
            ref |= dict.fromkeys((*STATISTICS, "recent_window_mean", "previous_window_mean"))
        else:
            ref |= {
                "mean": observed.mean(),
                "std": observed.std(ddof=0),
                "min": observed.min(),
                "p25": np.percentile(observed, 25),
                "p50": np.percentile(observed, 50),
                "p75": np.percentile(observed, 75),
                "max": observed.max(),
                "recent_window_mean": observed[-window:].mean(),
                "previous_window_mean": (
                    observed[max(0, len(observed) - 2 * window) : -window].mean()
                    if len(observed) > window
                    else None
                ),
            }
        out[name] = ref
    return out


def assert_result_json_matches(
    records: list[dict[str, Any]], sent: Sequence[pa.RecordBatch], window: int
) -> int:
    """Every aggregate of result.json equals the numpy reference of the sent batches; returns
    how many (layer, signal, metric) entries were checked, all of them."""
    reference = reference_statistics(sent, window)
    assert reference, "vacuous check: nothing was sent"
    seen: set[tuple[str, str, str]] = set()
    for record in records:
        for tensor in record["tensors"]:
            for metric, stats in tensor["statistics"].items():
                name = (record["layer"], tensor["signal"], metric)
                assert name not in seen, f"{name} listed twice"
                seen.add(name)
                for key, expected in reference[name].items():
                    got = stats[key]
                    if expected is None:
                        assert got is None, (name, key, got)
                    elif isinstance(expected, int):
                        assert got == expected, (name, key, got, expected)
                    else:
                        assert got is not None, (name, key)
                        assert math.isclose(got, float(expected), rel_tol=1e-12, abs_tol=1e-15), (
                            name,
                            key,
                            got,
                            float(expected),
                        )
    assert seen == set(reference), sorted(set(reference) ^ seen)
    return len(seen)
