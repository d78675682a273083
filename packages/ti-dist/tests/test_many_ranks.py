"""Hundreds of ranks: ``scan_ranks`` and ``compare_ranks`` stay lazy and bounded.

A job of 256 ranks, written as real Parquet files: even ranks finished (``history.parquet``),
odd ranks live or killed (``history.parts/``, dictionary-encoded strings). Memory is measured
(Python allocations with tracemalloc, the process with its RSS); time only has a generous
guard against a query that would take minutes.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl
import psutil
import pytest

from ti_dist import compare_ranks, scan_ranks
from ti_schema.layout import rank_dir_name

RANKS = 256
SAMPLES = 8
LAYERS = ("enc.0", "enc.1", "head")
OUTLIER_RANK = 137
NONFINITE_RANK = 201
GUARD_S = 60.0
"""Seconds, far above what these take (about one): only a query gone quadratic trips it."""

pytestmark = pytest.mark.slow


def value(rank: int, layer: int, sample: int) -> float:
    """Deterministic per-rank values: ranks differ a little, one rank a lot at sample 5."""
    if rank == OUTLIER_RANK and layer == 2 and sample == 5:
        return 1.0e6
    if rank == NONFINITE_RANK and layer == 0 and sample == 3:
        return float("nan")
    return 1.0 + 0.001 * ((rank * 7 + layer * 3 + sample) % 11)


@pytest.fixture(scope="module")
def job(
    tmp_path_factory: pytest.TempPathFactory,
    rows_for: Callable[..., list[dict[str, object]]],
    write: Callable[..., object],
) -> Path:
    root = tmp_path_factory.mktemp("ranks")
    for rank in range(RANKS):
        rows = []
        for i, layer in enumerate(LAYERS):
            for signal in ("output", "output_gradient"):
                values = [value(rank, i, s) for s in range(SAMPLES)]
                rows += rows_for(rank, values, layer=layer, signal=signal, metric="std")
        where = root / rank_dir_name(rank)
        if rank % 2:
            write(where / "history.parts" / "part-000000.parquet", rows, dictionary=True)
        else:
            write(where / "history.parquet", rows)
    return root


def measured(call: Callable[[], object]) -> tuple[object, float, int, int]:
    """``call()``'s result, its wall time, its peak Python allocation and its RSS growth."""
    process = psutil.Process()
    rss = process.memory_info().rss
    tracemalloc.start()
    start = time.perf_counter()
    try:
        result = call()
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, elapsed, peak, process.memory_info().rss - rss


def test_scan_ranks_builds_without_reading_a_file(job: Path) -> None:
    frame, elapsed, peak, _ = measured(lambda: scan_ranks(job))
    assert isinstance(frame, pl.LazyFrame)
    assert elapsed < GUARD_S
    assert peak < 16 * 2**20, f"building the scan allocated {peak / 2**20:.1f} MiB in Python"

    rows = frame.group_by("rank").agg(pl.len()).sort("rank").collect()
    assert rows.get_column("rank").to_list() == list(range(RANKS))
    assert set(rows.get_column("len").to_list()) == {len(LAYERS) * 2 * SAMPLES}

    # Lazy: a scan built before a rank's file changes reads the file as it is at collect time.
    late = job / rank_dir_name(254) / "history.parquet"
    original = late.read_bytes()
    rebuilt = scan_ranks(job)
    try:
        late.write_bytes(b"not parquet")
        with pytest.raises(Exception):  # noqa: B017, PT011 - Polars' error for a bad file
            rebuilt.select(pl.len()).collect()
    finally:
        late.write_bytes(original)
    assert rebuilt.select(pl.len()).collect().item() == RANKS * len(LAYERS) * 2 * SAMPLES


def test_compare_ranks_over_256_ranks_is_bounded_and_exact(job: Path) -> None:
    table, elapsed, peak, grown = measured(lambda: compare_ranks(job))
    assert isinstance(table, pl.DataFrame)
    assert elapsed < GUARD_S
    # Python holds the small result, never per-row objects; the process holds at most a few
    # copies of the 12,288 rows (their per-rank value lists included).
    assert peak < 32 * 2**20, f"Python allocations peaked at {peak / 2**20:.1f} MiB"
    assert grown < 1024 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"

    assert table.height == len(LAYERS) * 2 * SAMPLES
    assert set(table.get_column("n_ranks").to_list()) == {RANKS}
    for row in table.iter_rows(named=True):
        layer = LAYERS.index(row["layer"])
        values = np.array([value(r, layer, row["sample_id"]) for r in range(RANKS)])
        finite = values[np.isfinite(values)]
        assert row["ranks"] == list(range(RANKS))
        np.testing.assert_array_equal(np.array(row["values"], dtype=np.float64), values)
        assert row["min"] == finite.min()
        assert row["max"] == finite.max()
        assert row["median"] == pytest.approx(np.median(finite), rel=1e-12)
        expected = []
        if layer == 0 and row["sample_id"] == 3:
            assert row["nonfinite_ranks"] == [NONFINITE_RANK]
            expected.append(NONFINITE_RANK)
        if layer == 2 and row["sample_id"] == 5:
            assert row["outlier_ranks"] == [OUTLIER_RANK]
            assert row["max_rank"] == OUTLIER_RANK
            expected.append(OUTLIER_RANK)
        assert row["standout_ranks"] == expected, row

    standouts = compare_ranks(job, only_standouts=True)
    assert standouts.height == 2 * 2  # two signals each for the NaN and the outlier
    head = compare_ranks(job, layer="head", signal="output", metric="std", only_standouts=True)
    assert head.select("sample_id", "standout_ranks").rows() == [(5, [OUTLIER_RANK])]


def test_a_glob_over_the_finished_ranks_is_the_same_table(job: Path) -> None:
    """docs/distributed.md: ``pl.scan_parquet("stats/rank-*/history.parquet")`` reads the
    finished ranks (here the even ones) without TorchInstruments code, rows and ranks intact."""
    globbed = pl.scan_parquet(str(job / "rank-*" / "history.parquet")).collect()
    finished = scan_ranks(job).filter(pl.col("rank") % 2 == 0).collect()
    assert sorted(globbed.get_column("rank").unique().to_list()) == list(range(0, RANKS, 2))
    key = ["rank", "layer", "signal", "sample_id"]
    assert globbed.sort(key).equals(finished.sort(key))
