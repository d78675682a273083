"""The precision metrics through the contract and the readers, from a real training run.

A run with ``precision=`` writes ``min_abs_nonzero`` and ``<metric>.<format>`` rows; the
validators accept exactly the declared names; result.json, ``ti summary --metric``,
``ti compare``, index.md (its low-precision query runs as written), ti-dist's
``compare_ranks`` and ``combine_shards`` (exact: fractions by counts) handle them like any
metric. The reference of every value is torch's own cast of the same tensor.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from ti_core import DefaultProfile, EveryNForwardsSampler, inject_observer, remove_observer
from ti_core.reduction import ReductionPlan
from ti_core.reduction.precision import precision_engines
from ti_dist import combine_shards, compare_ranks
from ti_schema import (
    DEFAULT_PROFILE,
    FULL_PRECISION_PROFILE,
    SchemaMismatchError,
    precision_profile,
    profile_of,
    validate_history,
)
from ti_schema.testing import example_history_table

FORMATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "mxfp8_e4m3")
PROFILE = precision_profile(FORMATS)
TI = str(Path(sys.executable).with_name("ti"))


def _train(out: Path) -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(40, 40), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(40, 2))
    inject_observer(
        model,
        output_dir=out,
        sampler=EveryNForwardsSampler(1),
        precision=FORMATS,
        signals=("output", "output_gradient", "parameter", "parameter_gradient"),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(2):
            loss = model(torch.randn(8, 40, generator=g)).square().mean() * 1e-5
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        remove_observer(model)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("precision") / "run"
    _train(out)
    return out


def test_the_history_holds_the_declared_metrics_in_order(run: Path) -> None:
    history = pl.read_parquet(run / "history.parquet")
    metrics = history["metric"].cast(pl.String).unique(maintain_order=True).to_list()
    assert metrics == list(PROFILE.names)
    assert profile_of(metrics) == PROFILE
    assert set(history["signal"].cast(pl.String)) == {
        "output",
        "output_gradient",
        "parameter",
        "parameter_gradient",
    }
    grads = history.filter(
        (pl.col("signal") == "output_gradient")
        & (pl.col("metric") == "underflow_fraction.float8_e4m3fn")
    )
    assert grads["value"].max() > 0  # tiny gradients: float8_e4m3fn would flush some
    table = pq.read_table(run / "history.parquet")
    validate_history(table, profile=PROFILE)


def test_result_json_index_md_and_ti_summary(run: Path) -> None:
    result = json.loads((run / "result.json").read_text())
    for layer in result:
        for tensor in layer["tensors"]:
            assert tuple(tensor["statistics"]) == PROFILE.names
    index = (run / "index.md").read_text()
    assert "| underflow_fraction.float8_e4m3fn | finite non-zero entries" in index
    assert "| min_abs_nonzero | smallest magnitude" in index
    code = next(b for b in re.findall(r"```python\n(.*?)```", index, re.S) if "RUN =" in b)
    scope: dict[str, object] = {}
    exec(compile(code, "index.md", "exec"), scope)  # the queries run as written
    low = scope["low_precision"]
    assert isinstance(low, pl.DataFrame)
    assert low.height > 0
    row = low.row(0, named=True)
    assert row["amax"] == max(abs(row["min"]), abs(row["max"]))
    assert row["dynamic_range"] == row["amax"] / row["min_abs_nonzero"]
    assert row["underflow"] is not None

    metric = "underflow_fraction.float8_e4m3fn"
    summary = subprocess.run(
        [TI, "summary", str(run), "--csv", "--metric", metric],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    table = pl.read_csv(summary.encode())
    assert table["metric"].unique().to_list() == [metric]
    twin = run.with_name("twin")
    if not twin.exists():
        shutil.copytree(run, twin)
    compared = subprocess.run(
        [TI, "compare", str(run), str(twin), "--csv", "--metric", metric],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert metric in compared


def test_ti_dist_reads_and_compares_them_across_ranks(run: Path) -> None:
    one = pl.read_parquet(run / "history.parquet").with_columns(pl.col("metric").cast(pl.String))
    both = pl.concat([one, one.with_columns(pl.lit(1, pl.Int32).alias("rank"))])
    metric = "overflow_fraction.mxfp8_e4m3"
    table = compare_ranks(both, metric=metric)
    assert table.height > 0
    assert set(table["metric"].cast(pl.String)) == {metric}


def _shard_frame(shards: list[torch.Tensor], names: tuple[str, ...]) -> pl.DataFrame:
    engines = precision_engines(FORMATS)
    plan = ReductionPlan([DefaultProfile(names, engines)])
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
        for j, name in enumerate(names)
    ]
    return pl.DataFrame(
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


def test_combine_shards_adds_the_counts_exactly() -> None:
    g = torch.Generator().manual_seed(2)
    whole = torch.randn(7, 64, generator=g) * torch.logspace(-12, 3, 64)
    whole[5:] = 0.0  # the last shard has finite entries, all zero: no min_abs_nonzero there
    shards = [whole[:2], whole[2:5], whole[5:]]
    frame = _shard_frame(shards, PROFILE.names)
    combined = combine_shards(frame)  # the profile follows from the metrics the rows hold
    values = dict(zip(combined["metric"], combined["value"], strict=True))
    reference = ReductionPlan([DefaultProfile(PROFILE.names, precision_engines(FORMATS))])
    want = reference.reduce([whole])
    for j, name in enumerate(PROFILE.names):
        spec = PROFILE.get(name)
        if spec.combine == "entry_mean" or name == "min_abs_nonzero":
            assert values[name] == want.values[0, j], name  # bit for bit
    assert values["min_abs_nonzero"] == float(whole[whole != 0].abs().min())
    assert (
        "underflow_fraction.bfloat16"
        not in combine_shards(frame, profile=DEFAULT_PROFILE)["metric"].to_list()
    )

    nothing = _shard_frame([torch.zeros(2, 3), torch.zeros(1, 3)], PROFILE.names)
    rows = combine_shards(nothing).filter(pl.col("metric") == "min_abs_nonzero")
    assert rows["value"].item() is None
    assert rows["unavailable_reason"].item() == "no non-zero finite entries"


def _with_metric(name: str, value: float) -> pa.Table:
    table = example_history_table(27)
    row = {c: table.column(c)[0:1] for c in table.column_names}
    row["metric"] = pa.chunked_array([pa.array([name])]).cast(table.schema.field("metric").type)
    row["value"] = pa.chunked_array([pa.array([value])])
    return pa.concat_tables([table, pa.table(row, schema=table.schema)], promote_options="none")


def test_the_validators_accept_only_declared_metrics_and_formats() -> None:
    validate_history(_with_metric("underflow_fraction.float8_e5m2", 0.25))
    validate_history(_with_metric("min_abs_nonzero", 1e-30))
    validate_history(_with_metric("grad.norm", 3.0))  # a custom name with a dot: any
    with pytest.raises(SchemaMismatchError, match=r"unknown format 'fp4'"):
        validate_history(_with_metric("underflow_fraction.fp4", 0.25))
    with pytest.raises(SchemaMismatchError, match=r"'zero_fraction'.*not a precision metric"):
        validate_history(_with_metric("zero_fraction.bfloat16", 0.25))
    with pytest.raises(SchemaMismatchError, match=r"overflow_fraction.float16.*outside \[0, 1\]"):
        validate_history(
            _with_metric("overflow_fraction.float16", 1.5), profile=FULL_PRECISION_PROFILE
        )
