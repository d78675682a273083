"""``scan_ranks`` on object storage: an all-ranks layout of 200 ``rank-NNN/`` prefixes on a
real S3-protocol server on loopback (moto, packages/ti-io/tests/s3_server.py), listed with a
handful of list calls (the server's own request log), read back equal to the same layout on
disk, and never written to."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pytest

from ti_dist import scan_ranks
from ti_schema.layout import rank_dir_name

_SPEC = importlib.util.spec_from_file_location(
    "s3_server", Path(__file__).parents[2] / "ti-io" / "tests" / "s3_server.py"
)
assert _SPEC is not None
assert _SPEC.loader is not None
s3_server = importlib.util.module_from_spec(_SPEC)
sys.modules["s3_server"] = s3_server
_SPEC.loader.exec_module(s3_server)
moto, s3 = s3_server.moto, s3_server.s3  # the fixtures (an S3Store each test)

RANKS = 200
SAMPLES = 3


def _layout(
    root: Path,
    rows_for: Callable[..., list[dict[str, object]]],
    write: Callable[..., pa.Table],
) -> None:
    """Even ranks finished (history.parquet), odd ranks live (a part, dictionary strings)."""
    for rank in range(RANKS):
        values = [float(rank + s) for s in range(SAMPLES)]
        directory = root / rank_dir_name(rank)
        if rank % 2 == 0:
            write(directory / "history.parquet", rows_for(rank, values))
        else:
            part = directory / "history.parts" / "part-000000.parquet"
            write(part, rows_for(rank, values), dictionary=True)


def test_scan_ranks_lists_hundreds_of_rank_prefixes_in_a_few_calls(
    tmp_path: Path,
    s3: Any,
    rows_for: Callable[..., list[dict[str, object]]],
    write: Callable[..., pa.Table],
) -> None:
    local = tmp_path / "job"
    _layout(local, rows_for, write)
    s3.upload(local, "job")
    objects = len(s3.keys("job"))
    assert objects == RANKS  # one object under each of 200 rank prefixes

    before = len(s3.requests())
    frame = scan_ranks(s3.uri("job"))
    remote = frame.collect()
    seen = s3.requests()[before:]
    # One recursive listing of the whole prefix: ListObjectsV2 pages of 1,000 keys, never a
    # listing per rank prefix.
    assert len([r for r in seen if r.is_list]) == 1
    assert [r for r in seen if r.is_write] == []

    keys = ["rank", "sample_id"]
    expected = scan_ranks(local).collect().sort(keys)
    assert remote.sort(keys).equals(expected)
    assert remote.get_column("rank").n_unique() == RANKS
    assert remote.height == RANKS * SAMPLES
    for rank in (0, 1, 137, RANKS - 1):  # each rank's values as written
        got = remote.filter(pl.col("rank") == rank).sort("sample_id").get_column("value")
        assert got.to_list() == [float(rank + s) for s in range(SAMPLES)]


def test_scan_ranks_names_the_uri_it_cannot_read(s3: Any) -> None:
    with pytest.raises(FileNotFoundError, match=f"{s3.uri('none')}: no run there"):
        scan_ranks(s3.uri("none"))


def test_cross_rank_readers_read_a_run_on_the_store_as_on_disk(
    tmp_path: Path,
    s3: Any,
    rows_for: Callable[..., list[dict[str, object]]],
    write: Callable[..., pa.Table],
) -> None:
    """compare_ranks, replica_drift and ``ti drift`` take the run's URI (its objects read
    into a private copy, never written) and give what they give for the same run on disk."""
    from ti_dist import compare_ranks, replica_drift
    from ti_io.cli import main

    local = tmp_path / "job"
    for rank in range(3):
        values = [float(s) + (0.5 if rank == 2 and s >= 2 else 0.0) for s in range(4)]
        rows = rows_for(rank, values, signal="parameter", layer="fc")
        write(local / rank_dir_name(rank) / "history.parquet", rows)
    s3.upload(local, "job")
    before = len(s3.requests())
    assert compare_ranks(s3.uri("job")).equals(compare_ranks(local))
    assert replica_drift(s3.uri("job")).equals(replica_drift(local))
    assert main(["drift", s3.uri("job")]) == main(["drift", str(local)]) == 1
    assert [r for r in s3.requests()[before:] if r.is_write] == []
