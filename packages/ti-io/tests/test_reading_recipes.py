"""docs/reading-at-scale.md's recipe, run: DuckDB reads a multi-rank run on a real S3-protocol
server (moto on loopback, s3_server.py) through a pyarrow dataset, with the query the page
shows, and reproduces ``ti summary --csv`` of every rank (skipped outside the repository, where
the page is not)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import polars as pl
import pytest
from _io_helpers import Synth, make_run
from s3_server import S3Store

from ti_io import DirectorySink, HistoryConfig
from ti_io.cli import main
from ti_io.read.aggregates import AGGREGATES
from ti_io.read.ordering import GROUP_KEYS

DOC = Path(__file__).resolve().parents[3] / "docs" / "reading-at-scale.md"
RANKS = 3
SAMPLES = 55  # past both windows (20 and 40 observations)
KEYS = list(GROUP_KEYS)
NUMBERS = ["latest_sample", "latest", "observations", "unavailable", *AGGREGATES]
"""``ti summary --csv``'s numbers, which the query reproduces."""


def recipe(name: str) -> str:
    """The fenced query under ``<!-- recipe: NAME -->`` in docs/reading-at-scale.md."""
    if not DOC.is_file():
        pytest.skip(f"{DOC} is not here (installed-wheel test run)")
    text = DOC.read_text(encoding="utf-8")
    found = re.search(rf"<!-- recipe: {name} -->\n```sql\n(.*?)```", text, re.DOTALL)
    assert found, f"no <!-- recipe: {name} --> query in {DOC}"
    return found.group(1)


def _rank_run(directory: Path, rank: int) -> None:
    s = Synth(make_run(), seed=rank, empty_every=4)  # unavailable values, with reasons
    sink = DirectorySink(directory, history_config=HistoryConfig(window=20))
    sink.open(s.run)
    for sample in range(SAMPLES):
        batch = s.history(sample)
        sink.write_history(
            batch.set_column(
                1, "rank", pl.Series([rank] * batch.num_rows, dtype=pl.Int32).to_arrow()
            )
        )
    sink.close()


def test_duckdb_reads_a_multi_rank_run_on_s3_as_ti_summary_does(
    tmp_path: Path, s3: S3Store, capsys: pytest.CaptureFixture[str]
) -> None:
    duckdb = pytest.importorskip("duckdb")
    import pyarrow.dataset as ds
    import pyarrow.fs as fs

    query = recipe("duckdb")
    for rank in range(RANKS):
        _rank_run(tmp_path / "job" / f"rank-{rank:03d}", rank)
    s3.upload(tmp_path / "job", "job")

    # The page's snippet, with the test server's filesystem.
    files = s3.filesystem.get_file_info(fs.FileSelector(s3.key("job"), recursive=True))
    history = ds.dataset(
        [f.path for f in files if f.path.endswith("/history.parquet")],
        format="parquet",
        filesystem=s3.filesystem,
    )
    assert history.count_rows() == RANKS * SAMPLES * 36
    connection = duckdb.connect()
    connection.register("history", history)
    table = connection.sql(query).pl()

    compared = 0
    for rank in range(RANKS):
        assert main(["summary", s3.uri("job", f"rank-{rank:03d}"), "--csv"]) == 0
        summary = pl.read_csv(io.StringIO(capsys.readouterr().out), infer_schema_length=None)
        summary = summary.filter(pl.col("executed")).select(*KEYS, *NUMBERS)
        mine = table.filter(pl.col("rank") == rank).select(*KEYS, *NUMBERS)
        joined = summary.join(mine, on=KEYS, how="full", suffix="_duckdb", nulls_equal=True)
        assert joined.height == summary.height == mine.height == 36
        for name in NUMBERS:
            ours = joined.get_column(name).cast(pl.Float64).to_list()
            theirs = joined.get_column(f"{name}_duckdb").cast(pl.Float64).to_list()
            for a, b in zip(ours, theirs, strict=True):
                assert (a is None) == (b is None), (rank, name, a, b)
                if a is not None:
                    assert a == pytest.approx(b, rel=1e-12, abs=1e-12), (rank, name)
                    compared += 1
    assert compared > RANKS * 36 * 10, "vacuous: few numbers compared"
    assert table.get_column("unavailable").sum() > 0, "vacuous: no unavailable value"
