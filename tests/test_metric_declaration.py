"""A new metric is one declaration plus one function per engine, and everything follows.

The test declares ``positive_fraction`` (entries greater than zero over the element count) in a
copy of the default profile, gives each reduction engine its function, and checks that the
profile-row layout, both engines' rows (every code path, against a numpy float64 reference),
a real training run's history, result.json, ``ti summary``, ``combine_shards`` and the
validators all follow, while the default profile itself is unchanged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from ti_core import DefaultProfile, EveryNForwardsSampler, inject_observer, remove_observer
from ti_core.reduction import ReductionPlan, numpy_rows, torch_rows
from ti_core.reduction.engines import DEFAULT_ENGINES, ProfileEngines
from ti_dist import combine_shards
from ti_schema import (
    DEFAULT_METRICS,
    DEFAULT_PROFILE,
    MetricSpec,
    SchemaMismatchError,
    validate_history,
)

POSITIVE = MetricSpec(
    "positive_fraction",
    "entries greater than zero divided by the element count",
    "all",
    fraction=True,
    combine="entry_mean",
)


def _numpy_positive(rows: numpy_rows.Rows) -> np.ndarray:
    return np.count_nonzero(rows.entries > 0, axis=-1) / rows.numel


def _torch_positive(rows: torch_rows.Rows) -> torch.Tensor:
    return (rows.entries > 0).sum(-1).to(torch.float64) / rows.numel


ENGINES: ProfileEngines = DEFAULT_ENGINES.extended(
    POSITIVE, numpy=_numpy_positive, torch=_torch_positive
)
NAMES = (*DEFAULT_METRICS, "positive_fraction")


def _reference(a: np.ndarray) -> float:
    return float(np.count_nonzero(a.astype(np.float64) > 0)) / a.size


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    small = torch.randn(7, 5, generator=g)
    small[0, 0] = float("nan")
    small[1, 1] = float("inf")
    small[2, :] = 0.0
    large = torch.randn(70_000, generator=g)  # over the batching limit: the one-pass path
    large[::7] = float("-inf")
    return [small, torch.randn(3, generator=g), large, torch.full((4,), float("nan"))]


def test_the_layout_is_derived_from_the_declaration() -> None:
    assert ENGINES.metrics.names == NAMES
    assert ENGINES.layout.columns == (*NAMES, "finite_count")
    assert ENGINES.layout.width == len(DEFAULT_METRICS) + 2
    assert ENGINES.layout.index("positive_fraction") == len(DEFAULT_METRICS)
    # the defaults are untouched by the copy
    assert DEFAULT_PROFILE.names == DEFAULT_METRICS
    assert "positive_fraction" not in DEFAULT_ENGINES.numpy
    assert DEFAULT_ENGINES.layout.width == len(DEFAULT_METRICS) + 1


def test_a_metric_without_an_engine_function_is_refused() -> None:
    with pytest.raises(ValueError, match=r"torch engine has no function.*positive_fraction"):
        ProfileEngines(
            DEFAULT_PROFILE.extended([POSITIVE]),
            {**numpy_rows.METRICS, "positive_fraction": _numpy_positive},
            torch_rows.METRICS,
        )


def test_every_engine_path_computes_the_new_metric_exactly() -> None:
    tensors = _tensors()
    plan = ReductionPlan([DefaultProfile(NAMES, ENGINES)])
    assert plan.metric_names == NAMES
    got = plan.reduce(tensors)  # CPU: the numpy engine, batched and one-pass paths
    col = NAMES.index("positive_fraction")
    for i, t in enumerate(tensors):
        assert got.available[i, col]
        assert got.values[i, col] == _reference(t.numpy()), i
    # the other metrics are what the default profile gives
    default = ReductionPlan([DefaultProfile()]).reduce(tensors)
    np.testing.assert_array_equal(got.values[:, : len(DEFAULT_METRICS)], default.values)

    lay, fns = ENGINES.layout, ENGINES.torch
    col = lay.index("positive_fraction")
    batched = torch_rows.batched_rows([[tensors[0]], [tensors[1]]], torch.device("cpu"), lay, fns)
    assert batched.shape == (2, lay.width)
    for row, t in zip(batched, tensors[:2], strict=True):
        assert float(row[col]) == _reference(t.numpy())
    large = tensors[2]
    for row in (
        torch_rows.large_row_exact(large, lay, fns),
        torch_rows.large_row_optimistic(large, lay, fns),
    ):
        assert row.shape == (lay.width,)
        assert float(row[col]) == _reference(large.numpy())
    nothing_finite = torch_rows.large_row_exact(tensors[3], lay, fns)
    assert float(nothing_finite[col]) == 0.0


def _train(out: Path) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    inject_observer(
        model,
        output_dir=out,
        sampler=EveryNForwardsSampler(1),
        reducers=[DefaultProfile(NAMES, ENGINES)],
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            x = torch.randn(5, 6, generator=g)
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        remove_observer(model)
    return model


def test_a_run_result_json_and_ti_summary_carry_the_new_metric(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _train(out)
    history = pl.read_parquet(out / "history.parquet")
    metrics = history["metric"].cast(pl.String).unique(maintain_order=True).to_list()
    assert metrics == list(NAMES)  # emitted in declaration order
    relu = history.filter(
        (pl.col("layer") == "1") & (pl.col("signal") == "output") & (pl.col("sample_id") == 0)
    )
    assert set(relu["metric"].cast(pl.String)) == set(NAMES)
    positive = relu.filter(pl.col("metric") == "positive_fraction")["value"].item()
    zero = relu.filter(pl.col("metric") == "zero_fraction")["value"].item()
    assert positive == pytest.approx(1.0 - zero)  # a ReLU output is positive or zero

    result = json.loads((out / "result.json").read_text())
    for layer in result:
        for tensor in layer["tensors"]:
            assert tuple(tensor["statistics"]) == NAMES, (layer["layer"], tensor)

    summary = subprocess.run(
        [str(Path(sys.executable).with_name("ti")), "summary", str(out), "--csv"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    table = pl.read_csv(summary.encode())
    listed = table["metric"].unique(maintain_order=True).to_list()
    assert listed == list(NAMES)  # the run's declared order, the new metric last

    table_arrow = pq.read_table(out / "history.parquet")
    validate_history(table_arrow, profile=ENGINES.metrics)


def test_the_validators_check_the_declared_fractions() -> None:
    from ti_schema.testing import example_history_table

    table = example_history_table(27)
    row = {name: table.column(name)[0:1] for name in table.column_names}
    row["metric"] = pa.chunked_array([pa.array(["positive_fraction"])]).cast(
        table.schema.field("metric").type
    )
    row["value"] = pa.chunked_array([pa.array([1.5])])
    bad = pa.concat_tables([table, pa.table(row, schema=table.schema)], promote_options="none")
    validate_history(bad)  # metric values are checked only against a declaration
    validate_history(bad, profile=DEFAULT_PROFILE)  # which does not declare it: any value
    with pytest.raises(SchemaMismatchError, match=r"positive_fraction.*outside \[0, 1\]"):
        validate_history(bad, profile=ENGINES.metrics)


def test_combine_shards_follows_the_declared_rule() -> None:
    g = torch.Generator().manual_seed(2)
    whole = torch.randn(6, 4, generator=g)
    whole[4:, :] = 0.0
    shards = [whole[:2], whole[2:]]  # unequal shards: the weights matter
    plan = ReductionPlan([DefaultProfile(NAMES, ENGINES)])
    measured = plan.reduce(shards)
    rows = [
        {
            "layer": "fc",
            "call_index": 0,
            "signal": "parameter",
            "tensor_path": "weight@S(0)",
            "sample_id": 0,
            "rank": rank,
            "shape": list(shard.shape),
            "metric": name,
            "value": float(measured.values[rank, j]) if measured.available[rank, j] else None,
        }
        for rank, shard in enumerate(shards)
        for j, name in enumerate(NAMES)
    ]
    frame = pl.DataFrame(
        rows,
        schema={
            "layer": pl.String,
            "call_index": pl.Int32,
            "signal": pl.String,
            "tensor_path": pl.String,
            "sample_id": pl.Int64,
            "rank": pl.Int32,
            "shape": pl.List(pl.Int64),
            "metric": pl.String,
            "value": pl.Float64,
        },
    )
    combined = combine_shards(frame, profile=ENGINES.metrics)
    values = dict(zip(combined["metric"], combined["value"], strict=True))
    assert tuple(combined["metric"].unique(maintain_order=True)) == tuple(sorted(NAMES))
    assert values["positive_fraction"] == pytest.approx(_reference(whole.numpy()), abs=1e-15)
    assert values["zero_fraction"] == pytest.approx(2 / 6, abs=1e-15)  # rows 4 and 5 of 6
    assert values["p50"] is None  # declared not combinable
    default = combine_shards(frame)
    assert "positive_fraction" not in default["metric"].to_list()
