"""combine_shards: whole-tensor statistics of a sharded parameter from its shards' rows,
against numpy float64 on the whole tensor."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ti_dist import combine_shards
from ti_dist.shards import QUARTILE_REASON
from ti_schema import DEFAULT_METRICS, history_schema


def profile(values: np.ndarray) -> dict[str, float | None]:
    """What ti-core records for one tensor: the default profile, numpy float64."""
    flat = values.astype(np.float64).ravel()
    if flat.size == 0:
        return dict.fromkeys(DEFAULT_METRICS)
    finite = flat[np.isfinite(flat)]
    out: dict[str, float | None] = {
        "zero_fraction": float(np.mean(flat == 0)),
        "nonfinite_fraction": float(np.mean(~np.isfinite(flat))),
    }
    if finite.size == 0:
        return {**dict.fromkeys(DEFAULT_METRICS), **out}
    quartiles = np.percentile(finite, [25, 50, 75])
    return {
        **out,
        "mean": float(finite.mean()),
        "std": float(finite.std()),
        "min": float(finite.min()),
        "max": float(finite.max()),
        "p25": float(quartiles[0]),
        "p50": float(quartiles[1]),
        "p75": float(quartiles[2]),
    }


def shard_rows(
    rank: int,
    sample: int,
    shard: np.ndarray,
    *,
    path: str = "weight@S(0)",
    signal: str = "parameter",
) -> list[dict[str, Any]]:
    return [
        {
            "run_id": f"run-{rank}",
            "rank": rank,
            "sample_id": sample,
            "forward_index": 3 * sample,
            "timestamp": datetime(2026, 1, 1, tzinfo=UTC),
            "layer": "fc",
            "module_type": "Linear",
            "call_index": 0,
            "signal": signal,
            "tensor_path": path,
            "mode": "train",
            "grad_enabled": True,
            "shape": list(shard.shape),
            "dtype": "float32",
            "metric": metric,
            "value": value,
            "unavailable_reason": None if value is not None else "empty tensor (numel=0)",
        }
        for metric, value in profile(shard).items()
    ]


def write(directory: Path, rows: list[dict[str, Any]]) -> None:
    directory.mkdir(parents=True)
    pq.write_table(
        pa.Table.from_pylist(rows, schema=history_schema()), directory / "history.parquet"
    )


def test_shards_combine_to_the_whole_tensor(tmp_path: Path) -> None:
    """Four ranks hold uneven row blocks of a (9, 5) weight (the last one none, as FSDP2 gives
    a rank when there are too few rows); NaN and zeros included. Exact statistics equal numpy's
    on the whole tensor; quartiles are null with the reason."""
    rng = np.random.default_rng(11)
    wholes = []
    by_rank: dict[int, list[dict[str, Any]]] = {r: [] for r in range(4)}
    for sample in range(2):
        whole = rng.normal(0.5, 2.0, size=(9, 5)).astype(np.float32)
        whole[1, 2] = np.nan
        whole[7, :2] = 0.0
        wholes.append(whole.astype(np.float64))
        for rank, block in enumerate((whole[:4], whole[4:7], whole[7:], whole[9:])):
            by_rank[rank] += shard_rows(rank, sample, block)
            by_rank[rank] += shard_rows(rank, sample, block, path="weight", signal="output")
    for rank, rows in by_rank.items():
        write(tmp_path / f"rank-{rank:03d}", rows)

    table = combine_shards(tmp_path)
    assert set(table["tensor_path"]) == {"weight@S(0)"}  # the whole-tensor rows are left alone
    assert table.height == 2 * len(DEFAULT_METRICS)
    for row in table.iter_rows(named=True):
        whole = wholes[row["sample_id"]]
        assert (row["parameter"], row["shape"], row["n_ranks"]) == ("weight", [9, 5], 4)
        assert row["ranks"] == [0, 1, 2, 3]
        expected = profile(whole)[row["metric"]]
        if row["metric"] in ("p25", "p50", "p75"):
            assert row["value"] is None
            assert row["unavailable_reason"] == QUARTILE_REASON
        else:
            assert row["unavailable_reason"] is None
            assert row["value"] == pytest.approx(expected, rel=1e-12, abs=1e-15), row["metric"]


def test_a_missing_rank_or_value_is_explained_not_guessed() -> None:
    rng = np.random.default_rng(2)
    whole = rng.normal(size=(6, 3))
    rows = [*shard_rows(0, 0, whole[:3]), *shard_rows(1, 0, whole[3:])]
    rows += shard_rows(0, 1, whole[:3])  # rank 1 did not write sample 1
    broken = shard_rows(1, 2, whole[3:])
    for r in broken:
        if r["metric"] == "std":
            r["value"], r["unavailable_reason"] = None, "ValueError: boom"
    rows += [*shard_rows(0, 2, whole[:3]), *broken]
    frame = pl.from_arrow(pa.Table.from_pylist(rows, schema=history_schema()))
    assert isinstance(frame, pl.DataFrame)
    table = combine_shards(frame)
    reasons = {
        sample: set(table.filter(pl.col("sample_id") == sample)["unavailable_reason"].to_list())
        for sample in (1, 2)
    }
    assert reasons[1] == {"not combinable: the shards of ranks [1] are missing"}
    assert reasons[2] == {
        "not combinable: a value needed is unavailable on rank(s) [1] (see their rows)"
    }
    first = table.filter(pl.col("sample_id") == 0, pl.col("metric") == "std")
    assert first["value"].item() == pytest.approx(whole.std(), rel=1e-12)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="source must be an output_dir path"):
        combine_shards(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="align_on must be"):
        combine_shards(pl.DataFrame(), align_on="step")  # type: ignore[arg-type]


def test_stability_metrics_combine_where_declared(tmp_path: Path) -> None:
    """rms and max_abs (ti_schema.stability) combine exactly from the shards; kurtosis is
    null with its declared reason."""
    from ti_schema import STABILITY_METRICS
    from ti_schema.stability import KURTOSIS

    rng = np.random.default_rng(12)
    whole = rng.standard_t(4, size=(10, 6))
    whole[3, 3] = np.inf

    def stability(values: np.ndarray) -> dict[str, float]:
        f = values[np.isfinite(values)]
        d = f - f.mean()
        return {
            "rms": float(np.sqrt((f * f).mean())),
            "kurtosis": float((d**4).mean() / (d**2).mean() ** 2 - 3),
            "max_abs": float(np.abs(f).max()),
        }

    for rank, block in enumerate((whole[:3], whole[3:])):
        rows = shard_rows(rank, 0, block)
        for metric, value in stability(block).items():
            rows.append({**rows[0], "metric": metric, "value": value})
        write(tmp_path / f"rank-{rank:03d}", rows)
    table = combine_shards(tmp_path)
    got = {r["metric"]: r for r in table.iter_rows(named=True)}
    assert set(STABILITY_METRICS) <= set(got)
    want = stability(whole)
    for metric in ("rms", "max_abs"):
        assert got[metric]["value"] == pytest.approx(want[metric], rel=1e-12), metric
    assert got["kurtosis"]["value"] is None
    assert got["kurtosis"]["unavailable_reason"] == (
        f"not combinable: {KURTOSIS.not_combinable} (each rank's own rows have them)"
    )
