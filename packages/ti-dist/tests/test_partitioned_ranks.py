"""The cross-rank readers on a run directory read it a range of steps at a time
(``ti_dist.partitions.RankPartitions``, docs/reading-at-scale.md): forced into many partitions
(``TI_IO_PARTITION_ROWS``, the smallest allowed), they give exactly the tables the same rows
give read whole from a frame, and ``ti drift`` prints the same report."""

from __future__ import annotations

import contextlib
import io
import itertools
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from ti_dist import combine_shards, compare_ranks, first_drift, replica_drift
from ti_dist.partitions import RankPartitions
from ti_io.cli import main
from ti_io.read.spill import MIN_PARTITION_ROWS, PARTITION_ROWS_VARIABLE

HistoryRow = dict[str, object]
RANKS = 3
STEPS = 60
DRIFT_FROM = 41  # rank 1's fc.weight differs from this forward on


def _rows(rank: int) -> list[HistoryRow]:
    rng = np.random.default_rng(rank)
    rows: list[HistoryRow] = []
    for step in range(STEPS):
        shared = np.random.default_rng(1000 + step)
        for signal, layer, path in (
            ("output", "fc", ""),
            ("output", "act", ""),
            ("output_gradient", "fc", ""),
            ("parameter", "fc", "weight"),
            ("parameter", "fc", "bias"),
            ("parameter_gradient", "emb", "weight@S(0)"),  # a shard: its rank's own values
        ):
            for metric in ("mean", "std", "min", "max", "nonfinite_fraction", "zero_fraction"):
                if signal == "parameter" and path != "weight@S(0)":
                    value: float | None = float(shared.normal())  # the replicas' own value
                    if rank == 1 and layer == "fc" and path == "weight" and step >= DRIFT_FROM:
                        value += 1e-6
                else:
                    value = float(rng.normal())
                if metric in ("nonfinite_fraction", "zero_fraction"):
                    value = 0.0
                if metric == "std" and value is not None:
                    value = abs(value)
                if step % 17 == 3 and signal == "output" and layer == "act":
                    value = None
                rows.append(
                    {
                        "run_id": f"run-{rank}",
                        "rank": rank,
                        "sample_id": step,
                        "forward_index": step,
                        "timestamp": datetime(2026, 1, 1, tzinfo=UTC),
                        "layer": layer,
                        "module_type": "Linear",
                        "call_index": 0,
                        "signal": signal,
                        "tensor_path": path,
                        "mode": "train",
                        "grad_enabled": True,
                        "shape": [2 + rank, 4] if path.endswith("@S(0)") else [4, 4],
                        "dtype": "float32",
                        "metric": metric,
                        "value": value,
                        "unavailable_reason": None if value is not None else "no finite entries",
                    }
                )
    return rows


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, write: Callable[..., pa.Table]) -> Path:
    root = tmp_path_factory.mktemp("ranks")
    for rank in range(RANKS):
        write(root / f"rank-{rank:03d}" / "history.parquet", _rows(rank), dictionary=rank == 1)
    return root


@pytest.fixture
def frame(run: Path) -> pl.DataFrame:
    return pl.concat(
        [
            pl.read_parquet(run / f"rank-{rank:03d}" / "history.parquet").with_columns(
                pl.col(pl.Categorical).cast(pl.String)
            )
            for rank in range(RANKS)
        ]
    )


@pytest.fixture
def partitioned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PARTITION_ROWS_VARIABLE, str(MIN_PARTITION_ROWS))


def test_a_run_is_read_in_many_ranges_of_steps(run: Path, partitioned: None) -> None:
    """Each partition holds whole steps of every rank, in step order."""
    seen: list[tuple[int, int]] = []
    with RankPartitions(run, align="forward_index") as parts:
        assert parts.ranks == list(range(RANKS))
        frames = list(parts.frames())
    assert len(frames) >= 4, "vacuous: one partition"
    for frame in frames:
        steps = frame.group_by("forward_index").agg(pl.col("rank").n_unique().alias("ranks"))
        assert steps.get_column("ranks").to_list() == [RANKS] * steps.height
        seen.append((frame["forward_index"].min(), frame["forward_index"].max()))  # type: ignore[arg-type]
    assert seen == sorted(seen)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(seen))


def test_replica_drift_reads_the_same_in_partitions(
    run: Path, frame: pl.DataFrame, partitioned: None
) -> None:
    whole = replica_drift(frame)
    assert replica_drift(run).equals(whole)
    assert replica_drift(run, only_drift=True).equals(replica_drift(frame, only_drift=True))
    drift = first_drift(run)
    assert drift is not None
    assert drift == first_drift(frame)
    assert (drift.forward_index, drift.layer, drift.differing_ranks) == (DRIFT_FROM, "fc", (1,))


def test_compare_ranks_and_combine_shards_read_the_same_in_partitions(
    run: Path, frame: pl.DataFrame, partitioned: None
) -> None:
    assert compare_ranks(run).equals(compare_ranks(frame))
    picked = compare_ranks(run, metric="std", signal="output", layer="fc")
    assert picked.equals(compare_ranks(frame, metric="std", signal="output", layer="fc"))
    assert picked.height == STEPS
    combined = combine_shards(run, align_on="forward_index")
    assert combined.equals(combine_shards(frame, align_on="forward_index"))
    assert combined.height == STEPS * 9  # every metric of the default profile
    assert combined.get_column("shape").to_list()[0] == [2 + 3 + 4, 4]


def _drift_cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["drift", *args])
    return code, out.getvalue()


def test_ti_drift_reports_the_same_in_partitions(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = _drift_cli(str(run))
    whole_json = _drift_cli(str(run), "--json")
    monkeypatch.setenv(PARTITION_ROWS_VARIABLE, str(MIN_PARTITION_ROWS))
    assert _drift_cli(str(run)) == whole
    assert _drift_cli(str(run), "--json") == whole_json
    assert whole[0] == 1
    assert f"replicas differ at forward_index {DRIFT_FROM}" in whole[1]
    assert f"{STEPS} steps sampled on every rank" in whole[1]


@pytest.mark.parametrize("finalized", [True, False])
def test_a_rank_directory_missing_from_an_all_ranks_run_is_named(
    tmp_path: Path, finalized: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that recorded every rank (``rank_policy="all"``: run.json while live, index.md
    once finalized) with a rank directory missing is refused, naming it and what to do,
    instead of being compared without it."""
    from ti_io import DirectorySink
    from ti_schema import LayerInfo, RunInfo

    for rank in range(RANKS):
        info = RunInfo(
            run_id=f"run-{rank}",
            rank=rank,
            world_size=RANKS,
            producer="test",
            started_at=datetime(2026, 1, 1, tzinfo=UTC),
            layers=(LayerInfo("fc", "Linear"),),
            focus_layers=(),
            metrics=("mean",),
            sampler="AlwaysSampler()",
            settings={"rank_policy": "'all'"},
        )
        sink = DirectorySink(tmp_path / f"rank-{rank:03d}")
        sink.open(info)
        rows = [r for r in _rows(rank) if r["metric"] == "mean" and r["layer"] == "fc"]
        sink.write_history(pa.Table.from_pylist(rows, schema=_schema()).to_batches()[0])
        if finalized:
            sink.close()
        else:
            sink._flush_at_exit()  # what the interpreter-exit hook does: parts, no finalization
    assert compare_ranks(tmp_path).height  # every rank is there: read as usual
    shutil.rmtree(tmp_path / "rank-001")
    with pytest.raises(FileNotFoundError, match=r"rank-001/ is missing"):
        compare_ranks(tmp_path)
    assert main(["drift", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "world of 3 (rank_policy 'all'), but rank-001/ is missing" in err
    assert "Copy them in" in err


def _schema() -> pa.Schema:
    from ti_schema import history_schema

    return history_schema("test")
