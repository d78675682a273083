"""Replica drift (``replica_drift``, ``first_drift``, ``ti drift``) on real ``ti.history``
Parquet of four ranks, against a numpy float64 reference: the per-rank statistics of numpy
parameters, their spread across ranks, and exact agreement judged on the floats' bits."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ti_dist import Drift, first_drift, replica_drift
from ti_io.cli import main
from ti_schema import DEFAULT_METRICS, history_schema

HistoryRow = dict[str, object]

RANKS = 4
STEPS = (0, 2, 4, 6)  # forward_index of the sampled steps (every other forward)
PERTURBED_RANK = 2
PERTURBED_FROM = 4  # the first sampled step at which rank 2's fc.weight differs
METRICS = {
    "mean": np.mean,
    "std": np.std,
    "min": np.min,
    "max": np.max,
    "p50": lambda a: np.quantile(a, 0.5),
    "zero_fraction": lambda a: np.mean(a == 0),
}


def _row(
    rank: int, forward_index: int, layer: str, tensor_path: str, metric: str, value: float | None
) -> HistoryRow:
    return {
        "run_id": f"run-{rank}",
        "rank": rank,
        "sample_id": forward_index // 2,
        "forward_index": forward_index,
        "timestamp": datetime(2026, 1, 1, 0, 0, forward_index, tzinfo=UTC),
        "layer": layer,
        "module_type": "Linear",
        "call_index": 0,
        "signal": "parameter",
        "tensor_path": tensor_path,
        "mode": "train",
        "grad_enabled": True,
        "shape": [3, 4],
        "dtype": "float32",
        "metric": metric,
        "value": value,
        "unavailable_reason": None if value is not None else "no finite entries",
    }


def _parameters(rank: int, step: int) -> dict[tuple[str, str], np.ndarray]:
    """The float32 parameters rank ``rank`` holds at ``step``: the same on every rank, except
    rank 2's fc.weight from PERTURBED_FROM on (one element moved by 1e-3)."""
    generator = np.random.default_rng(step)
    weight = generator.standard_normal((3, 4)).astype(np.float32)
    bias = np.zeros(3, dtype=np.float32)
    bias[0] = generator.standard_normal()
    if rank == PERTURBED_RANK and step >= PERTURBED_FROM:
        weight[0, 0] += np.float32(1e-3)
    return {("fc", "weight"): weight, ("fc", "bias"): bias, ("", "scale"): weight[:1, :1] * 0}


def _stats(array: np.ndarray) -> dict[str, float]:
    values = array.astype(np.float64)
    return {name: float(fn(values)) for name, fn in METRICS.items()}


def write_history(path: Path, rows: list[HistoryRow]) -> None:
    """``rows`` as a ``ti.history`` Parquet file at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=history_schema("ti-dist-tests 0")), path)


def _write_run(root: Path, rows_by_rank: dict[int, list[HistoryRow]]) -> Path:
    for rank, rows in rows_by_rank.items():
        write_history(root / f"rank-{rank:03d}" / "history.parquet", rows)
    return root


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, str, str, str], list[float]]:
    """(forward_index, layer, tensor_path, metric) -> every rank's value (numpy float64)."""
    table: dict[tuple[int, str, str, str], list[float]] = {}
    for step in STEPS:
        for rank in range(RANKS):
            for (layer, path), array in _parameters(rank, step).items():
                for metric, value in _stats(array).items():
                    table.setdefault((step, layer, path, metric), []).append(value)
    return table


@pytest.fixture(scope="module")
def drifted_run(
    tmp_path_factory: pytest.TempPathFactory,
    reference: dict[tuple[int, str, str, str], list[float]],
) -> Path:
    rows: dict[int, list[HistoryRow]] = {rank: [] for rank in range(RANKS)}
    for (step, layer, path, metric), values in reference.items():
        for rank, value in enumerate(values):
            rows[rank].append(_row(rank, step, layer, path, metric, value))
    return _write_run(tmp_path_factory.mktemp("drifted"), rows)


def _bits(value: float) -> int:
    """The float's bits, every NaN one value (the documented rule: NaN agrees with NaN)."""
    return -1 if math.isnan(value) else int(np.array(value, dtype=np.float64).view(np.uint64))


def test_statistics_across_ranks_and_agreement_match_numpy(
    drifted_run: Path, reference: dict[tuple[int, str, str, str], list[float]]
) -> None:
    table = replica_drift(drifted_run)
    assert table.height == len(reference)
    for row in table.iter_rows(named=True):
        expected = reference[
            (row["forward_index"], row["layer"], row["tensor_path"], row["metric"])
        ]
        assert row["ranks"] == list(range(RANKS))
        assert row["values"] == expected
        assert (row["n_ranks"], row["missing_ranks"]) == (RANKS, [])
        finite = np.array(expected, dtype=np.float64)
        assert row["min"] == finite.min()
        assert row["max"] == finite.max()
        assert row["spread"] == finite.max() - finite.min()
        bits = [_bits(v) for v in expected]
        assert row["agree"] is (len(set(bits)) == 1)
        majority = max(set(bits), key=bits.count)
        assert row["differing_ranks"] == [r for r, b in enumerate(bits) if b != majority]
        assert _bits(row["reference"]) == majority
    drifted = table.filter(pl.col("agree").not_())
    # Only rank 2's fc.weight from step 4 on, in the metrics the perturbation moves.
    assert set(drifted["forward_index"]) == {4, 6}
    assert set(zip(drifted["layer"], drifted["tensor_path"], strict=True)) == {("fc", "weight")}
    assert set(drifted["metric"]) >= {"mean", "std"}
    assert drifted["differing_ranks"].to_list() == [[PERTURBED_RANK]] * drifted.height
    assert replica_drift(drifted_run, only_drift=True).equals(drifted)


def test_first_drift_names_the_rank_the_parameter_and_the_step(
    drifted_run: Path, reference: dict[tuple[int, str, str, str], list[float]]
) -> None:
    drift = first_drift(drifted_run)
    assert isinstance(drift, Drift)
    assert (drift.forward_index, drift.parameter, drift.signal) == (4, "fc.weight", "parameter")
    assert (drift.ranks, drift.differing_ranks) == ((0, 1, 2, 3), (PERTURBED_RANK,))
    assert drift.parameters_differing == 1
    assert set(drift.values) == set(METRICS)
    for metric, by_rank in drift.values.items():
        expected = reference[(4, "fc", "weight", metric)]
        assert by_rank == dict(enumerate(expected))
        assert drift.reference[metric] == expected[0]
        assert (metric in drift.differing_metrics) is (expected[2] != expected[0])
        differs = (PERTURBED_RANK,) if expected[2] != expected[0] else ()
        assert drift.metric_differing_ranks[metric] == differs
    assert list(drift.values) == [m for m in DEFAULT_METRICS if m in METRICS]  # profile order
    # The table replica_drift returned gives the same answer; before step 4 nothing differs.
    assert first_drift(replica_drift(drifted_run)) == drift
    assert first_drift(drifted_run, layer="fc", metric="zero_fraction") is None


def test_exactly_equal_means_the_same_stored_float(tmp_path: Path) -> None:
    one = 1.0
    cases = {  # metric -> each rank's value
        "same": [one, one, one, one],
        "one_ulp": [one, one, float(np.nextafter(one, 2.0)), one],
        "signed_zero": [0.0, -0.0, 0.0, 0.0],
        "nan": [math.nan, math.nan, math.nan, math.nan],
        "nan_one_rank": [one, one, one, math.nan],
        "null": [None, None, None, None],
        "null_one_rank": [one, None, one, one],
        "tie": [one, one, 2.0, 2.0],  # no majority: the lowest rank's value is the reference
    }
    rows = {
        rank: [_row(rank, 0, "fc", "weight", m, values[rank]) for m, values in cases.items()]
        for rank in range(RANKS)
    }
    table = replica_drift(_write_run(tmp_path, rows))
    found = {row["metric"]: row for row in table.iter_rows(named=True)}
    expected_differing = {
        "same": [],
        "one_ulp": [2],
        "signed_zero": [1],
        "nan": [],
        "nan_one_rank": [3],
        "null": [],
        "null_one_rank": [1],
        "tie": [2, 3],
    }
    for metric, differing in expected_differing.items():
        assert found[metric]["differing_ranks"] == differing, metric
        assert found[metric]["agree"] is (not differing), metric
    assert found["tie"]["reference"] == one
    assert found["null"]["reference"] is None
    assert found["null_one_rank"]["min"] == one  # over the values present and finite
    assert found["nan"]["spread"] is None


def test_steps_sampled_on_only_some_ranks_are_named_not_compared(tmp_path: Path) -> None:
    rows: dict[int, list[HistoryRow]] = {rank: [] for rank in range(RANKS)}
    for rank in range(RANKS):
        rows[rank].append(_row(rank, 0, "fc", "weight", "mean", 1.0))
        if rank != 3:  # rank 3 did not sample forward 2 (its own clock); rank 1 differs there
            rows[rank].append(_row(rank, 2, "fc", "weight", "mean", 5.0 if rank == 1 else 1.0))
        rows[rank].append(_row(rank, 3 if rank == 3 else 4, "fc", "weight", "mean", 1.0))
    run = _write_run(tmp_path, rows)
    table = replica_drift(run)
    by_step = {row["forward_index"]: row for row in table.iter_rows(named=True)}
    assert by_step[0]["agree"] is True
    for step, missing in ((2, [3]), (3, [0, 1, 2]), (4, [3])):
        assert by_step[step]["agree"] is None
        assert by_step[step]["differing_ranks"] is None
        assert by_step[step]["missing_ranks"] == missing
    assert first_drift(run) is None


def test_refuses_runs_without_parameter_rows_one_rank_or_several_runs(tmp_path: Path) -> None:
    outputs = {
        rank: [dict(_row(rank, 0, "fc", "", "mean", 1.0), signal="output")] for rank in range(2)
    }
    with pytest.raises(ValueError, match=r'signals=\(.*"parameter"\)'):
        replica_drift(_write_run(tmp_path / "outputs", outputs))
    alone = {0: [_row(0, 0, "fc", "weight", "mean", 1.0)]}
    with pytest.raises(ValueError, match=r'only rank 0 .* rank_policy="all"'):
        replica_drift(_write_run(tmp_path / "alone", alone))
    two = {rank: [_row(rank, 0, "fc", "weight", "mean", 1.0)] for rank in range(2)}
    run = _write_run(tmp_path / "two", two)
    write_history(
        run / "rank-001" / "history.parts" / "part-000000.parquet",
        [dict(_row(1, 0, "fc", "weight", "mean", 1.0), run_id="another")],
    )
    frame = pl.concat([pl.read_parquet(p) for p in sorted(run.rglob("*.parquet"))])
    with pytest.raises(ValueError, match=r"rank 1 has 2 rows .* filter by run_id"):
        replica_drift(frame)
    with pytest.raises(ValueError, match="layer=\\['nope'\\]"):
        replica_drift(run, layer="nope")
    with pytest.raises(ValueError, match="signal must be one of"):
        replica_drift(run, signal="output")


def test_ti_drift_prints_the_first_drift_and_exits_1(
    drifted_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["drift", str(drifted_run)]) == 1
    out = capsys.readouterr().out
    assert "ti drift: 4 ranks (0, 1, 2, 3); 4 steps sampled on every rank" in out
    assert "replicas differ at forward_index 4: parameter fc.weight" in out
    assert "rank 2 differs from ranks 0, 1, 3" in out
    drift = first_drift(drifted_run)
    assert drift is not None
    assert f"rank 2: {drift.values['mean'][2]!r}" in out  # each rank's value, as stored

    assert main(["drift", "--json", str(drifted_run)]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == replica_drift(drifted_run).height
    assert {r["forward_index"] for r in rows if r["agree"] is False} == {4, 6}


def test_ti_drift_agreement_and_what_it_cannot_compare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    same = {
        rank: [_row(rank, step, "fc", "weight", "mean", 0.5) for step in STEPS[:2]]
        for rank in range(2)
    }
    same[1].append(_row(1, 9, "fc", "weight", "mean", 0.5))
    assert main(["drift", str(_write_run(tmp_path / "same", same))]) == 0
    out = capsys.readouterr().out
    assert "1 steps not on every rank, not compared: forward_index 9 (missing ranks 0)" in out
    assert "all 2 ranks agree exactly on all 1 parameters at all 2 steps" in out

    alone = {0: [_row(0, 0, "fc", "weight", "mean", 1.0)]}
    assert main(["drift", str(_write_run(tmp_path / "alone", alone))]) == 2
    assert 'rank_policy="all"' in capsys.readouterr().err
    unaligned = {rank: [_row(rank, rank, "fc", "weight", "mean", 1.0)] for rank in range(2)}
    assert main(["drift", str(_write_run(tmp_path / "unaligned", unaligned))]) == 2
    assert "no step was sampled on every rank" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["drift", str(tmp_path / "empty")]) == 2
    assert "no history found" in capsys.readouterr().err
