"""Record batches built from the per-run cache of static identity columns: a repeated entry
list must still carry each batch's own timestamps, sample and forward index, and any change
of identity (shape, dtype, mode, signal) must show in the rows."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from test_records import METRICS, columns

from ti_core.emission.records import RunColumns, histogram_batch, history_batch
from ti_core.entries import Entry
from ti_core.reduction.histograms import histogram_rows
from ti_schema.testing import assert_history_conforms


def _entries(stamp: int, shape: tuple[int, ...] = (2, 3)) -> list[Entry]:
    return [Entry(i, i % 2, f"[{i}]", i != 1, True, shape, "float32", stamp + i) for i in range(3)]


def _batch(
    run: RunColumns, entries: list[Entry], signal: str, sample: int
) -> list[dict[str, object]]:
    n = len(entries)
    values = np.arange(n * len(METRICS), dtype=np.float64).reshape(n, len(METRICS)) + sample
    available = np.ones_like(values, dtype=bool)
    batch = history_batch(run, signal, sample, sample + 10, entries, values, available, [])
    assert_history_conforms(batch)
    return batch.to_pylist()


def test_repeated_entry_lists_keep_their_own_varying_columns() -> None:
    run = columns(3)
    for sample, stamp in ((0, 10**15), (1, 2 * 10**15), (2, 3 * 10**15)):
        entries = _entries(stamp)
        n = len(entries)
        values = np.full((n, len(METRICS)), float(sample))
        available = np.ones_like(values, dtype=bool)
        rows = history_batch(run, "output", sample, 7 + sample, entries, values, available, [])
        for k, row in enumerate(rows.to_pylist()):
            e = entries[k // len(METRICS)]
            assert (row["sample_id"], row["forward_index"]) == (sample, 7 + sample)
            assert int(row["timestamp"].timestamp() * 1e6) == e.timestamp_us
            assert row["value"] == float(sample)
            assert row["layer"] == f"blocks.{e.layer}"
            assert row["mode"] == ("train" if e.train else "eval")
            assert row["shape"] == [2, 3]


def test_identity_changes_are_not_served_from_the_cache() -> None:
    run = columns(3)  # one run: every batch below goes through the same cache
    base = _entries(1)
    first = _batch(run, base, "output", 0)
    reshaped = _batch(run, _entries(1, (4,)), "output", 1)
    regrad = _batch(run, _entries(1), "output_gradient", 2)
    recast = [dataclasses.replace(e, dtype="float16", train=False) for e in base]
    cast = _batch(run, recast, "output", 3)
    assert {tuple(r["shape"]) for r in first} == {(2, 3)}
    assert {tuple(r["shape"]) for r in reshaped} == {(4,)}
    assert {r["signal"] for r in regrad} == {"output_gradient"}
    assert {(r["dtype"], r["mode"]) for r in cast} == {("float16", "eval")}


def test_histogram_batch_columns() -> None:
    """Built as production builds them (histogram rows of real tensors): a spread tensor, one
    without finite entries (an empty histogram) and a single-valued one (one bucket)."""
    run = columns(3)
    inf, nan = math.inf, math.nan
    tensors = [
        torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, nan, inf]),
        torch.tensor([nan] * 4 + [inf, -inf, inf]),
        torch.full((9,), 2.5),
    ]
    rows = histogram_rows(tensors, bins=3)
    hists = rows.items()
    assert [len(h.bucket_counts) for h in hists] == [3, 0, 1]
    for stamp in (1, 2):  # the second batch reuses the cached identity columns
        batch = histogram_batch(run, "output", stamp, 4, _entries(stamp), rows)
        assert batch.schema.equals(run.histogram_schema, check_metadata=True)
        out = batch.to_pylist()
        assert [r["sample_id"] for r in out] == [stamp] * 3
        assert [int(r["timestamp"].timestamp() * 1e6) for r in out] == [
            stamp,
            stamp + 1,
            stamp + 2,
        ]
        for row, h in zip(out, hists, strict=True):
            assert row["bucket_limits"] == h.bucket_limits.tolist()
            assert row["bucket_counts"] == h.bucket_counts.tolist()
            assert (row["min"], row["max"]) == (h.min, h.max)
            assert (row["num"], row["sum"], row["sum_squares"]) == (h.num, h.sum, h.sum_squares)
            assert row["nonfinite_count"] == h.nonfinite_count
