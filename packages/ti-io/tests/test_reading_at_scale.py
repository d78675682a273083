"""The bounded-memory readers (docs/reading-at-scale.md): measurement ids, partitions on disk,
and the aggregations over them, each checked against a numpy float64 reference or against the
same reader holding everything in one partition.

A history is forced into many partitions with ``TI_IO_PARTITION_ROWS`` (the smallest allowed)
and ``ti compare``'s grid into many slices with a tiny ``CELLS``, so the paths a long run takes
run here on small data.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _io_helpers import Synth

from ti_io import DirectorySink, HistoryConfig
from ti_io.read import keys as keys_module
from ti_io.read.compare import compare_runs
from ti_io.read.keys import KeyCatalog
from ti_io.read.measurements import aggregate_files
from ti_io.read.ordering import GROUP_KEYS
from ti_io.read.row_groups import history_files
from ti_io.read.spill import MIN_PARTITION_ROWS, PARTITION_ROWS_VARIABLE, Partitions
from ti_io.read.summary import summary_table
from ti_schema import history_schema

ALIGNMENT = importlib.import_module("ti_io.read.alignment")
WINDOW = 3


def _key_table(rows: list[tuple[Any, ...]], *, dictionary: bool) -> pa.Table:
    columns = {name: [row[i] for row in rows] for i, name in enumerate(GROUP_KEYS)}
    schema = pa.schema(
        [
            ("layer", pa.string()),
            ("call_index", pa.int32()),
            ("signal", pa.string()),
            ("tensor_path", pa.string()),
            ("mode", pa.string()),
            ("grad_enabled", pa.bool_()),
            ("metric", pa.string()),
        ]
    )
    table = pa.table(columns, schema=schema)
    if dictionary:
        table = table.cast(
            pa.schema(
                f.with_type(pa.dictionary(pa.int32(), pa.string())) if f.type == pa.string() else f
                for f in schema
            )
        )
    return table


@pytest.mark.parametrize("dense", [True, False])
def test_key_catalog_gives_one_id_per_measurement_whatever_the_encoding(
    monkeypatch: pytest.MonkeyPatch, dense: bool
) -> None:
    """The same key tuple gets the same id in every row group: dictionaries in another order,
    plain strings, call indices in another range, nulls; ``frame()`` decodes the ids."""
    if not dense:
        monkeypatch.setattr(keys_module, "DENSE_TABLE_CODES", 1)  # the dictionary lookup
    rng = np.random.default_rng(3)
    layers = ["a", "b.0", "b.1", "c"]
    measurements = [
        (layer, call, signal, path, mode, grad, metric)
        for layer in layers
        for call in (0, 2, 7)
        for signal in ("output", "output_gradient")
        for path in ("", "[0]", None)
        for mode in ("train", "eval")
        for grad in (True, False, None)
        for metric in ("mean", "std")
    ]
    catalog = KeyCatalog()
    ids: dict[tuple[Any, ...], int] = {}
    for group in range(6):
        picked = [measurements[i] for i in rng.integers(0, len(measurements), size=500)]
        if group == 3:  # one row group holds only a narrower call range
            picked = [m for m in picked if m[1] == 2] or picked[:1]
        table = _key_table(picked, dictionary=group % 2 == 0)
        if group == 4:  # dictionaries in another order
            table = table.take(np.argsort([str(m) for m in picked])[::-1])
            picked = [picked[i] for i in np.argsort([str(m) for m in picked])[::-1]]
        got = catalog.ids(table)
        assert got.dtype == np.uint32
        for key, id_ in zip(picked, got.tolist(), strict=True):
            assert ids.setdefault(key, id_) == id_, key
    assert len(catalog) == len(ids)
    decoded = catalog.frame()
    for row in decoded.iter_rows():
        assert ids[tuple(row[1:])] == row[0]
        assert catalog.key(row[0]) == tuple(row[1:])


def test_partitions_route_each_measurement_to_one_partition_and_clean_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every row comes back once, in its partition (``key % count``), in the order it was
    added; nulls survive; the partition files are removed on close, and one partition never
    writes any."""
    spill = importlib.import_module("ti_io.read.spill")
    monkeypatch.setattr(spill, "MIN_BUFFER_ROWS", 8)
    monkeypatch.setattr(spill, "BUFFER_BYTES", 1024)  # flush often: many record batches
    schema = pa.schema([("key", pa.uint32()), ("order", pa.int64()), ("value", pa.float64())])
    rng = np.random.default_rng(0)
    added = []
    with Partitions(schema, 7, directory=tmp_path) as partitions:
        for start in range(0, 5000, 500):
            keys = rng.integers(0, 40, size=500).astype(np.uint32)
            values = pa.array(rng.normal(size=500), mask=rng.random(500) < 0.1)
            order = np.arange(start, start + 500)
            added.append(pl.DataFrame({"key": keys, "order": order, "value": values}))
            partitions.add(pa.record_batch([pa.array(keys), pa.array(order), values], schema))
        assert list(tmp_path.iterdir()), "vacuous: nothing was written to disk"
        frames = list(partitions.frames())
    assert not list(tmp_path.iterdir())
    everything = pl.concat(added)
    for frame in frames:
        assert (frame.get_column("key").cast(pl.Int64) % 7).n_unique() == 1
        assert frame.get_column("order").is_sorted()
    got = pl.concat(frames).sort("order")
    assert got.equals(everything.sort("order"))
    with Partitions(schema, 1, directory=tmp_path) as single:
        single.add(
            pa.record_batch([pa.array([1], pa.uint32()), pa.array([0]), pa.array([2.0])], schema)
        )
        assert not list(tmp_path.iterdir())
        assert next(single.frames()).height == 1


def _history(
    path: Path, samples: int, *, shuffled: bool, special: bool = False, seed: int = 1
) -> pa.Table:
    """A ``ti.history`` file of ``samples`` samples (several row groups): 3 layers x 2 signals
    x 3 metrics, some values unavailable (two reasons), shapes that change; ``shuffled``: rows
    out of sample order; ``special``: NaN and infinities among the values."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list[Any]] = {name: [] for name in history_schema().names}
    for sample in range(samples):
        for layer, kind in (("enc.0", "Linear"), ("enc.1", "ReLU"), ("head", "Linear")):
            for signal in ("output", "output_gradient"):
                for metric in ("mean", "std", "max"):
                    value: float | None = float(rng.normal(sample * 0.1, 1.0))
                    reason = None
                    if rng.random() < 0.08:
                        value = None
                        reason = "empty tensor (numel=0)" if rng.random() < 0.7 else "failed: x"
                    elif special and rng.random() < 0.05:
                        value = float(rng.choice([np.nan, np.inf, -np.inf]))
                    rows["run_id"].append("r")
                    rows["rank"].append(0)
                    rows["sample_id"].append(sample)
                    rows["forward_index"].append(sample)
                    rows["timestamp"].append(sample * 1_000_000)
                    rows["layer"].append(layer)
                    rows["module_type"].append(kind if sample else f"first-{kind}")
                    rows["call_index"].append(0)
                    rows["signal"].append(signal)
                    rows["tensor_path"].append("")
                    rows["mode"].append("train")
                    rows["grad_enabled"].append(True)
                    rows["shape"].append([sample % 5 + 1, 4])
                    rows["dtype"].append("float32" if sample % 2 else "bfloat16")
                    rows["metric"].append(metric)
                    rows["value"].append(value)
                    rows["unavailable_reason"].append(reason)
    table = pa.table(rows, schema=history_schema("ti-io tests"))
    if shuffled:
        table = table.take(rng.permutation(table.num_rows))
    pq.write_table(table, path, row_group_size=700)
    return table


def _reference(table: pa.Table, window: int) -> dict[tuple[Any, ...], dict[str, Any]]:
    """numpy float64 aggregates of every measurement of ``table`` (by sample order; the module
    type of its first row in the file)."""
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    first_type = {
        tuple(key): group.item(0, "module_type")
        for key, group in frame.group_by(list(GROUP_KEYS), maintain_order=True)
    }
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for key, group in frame.sort("sample_id").group_by(list(GROUP_KEYS), maintain_order=True):
        values = group.get_column("value")
        observed = values.drop_nulls().to_numpy()
        latest = group.row(int(group.get_column("sample_id").arg_max()), named=True)
        reasons = Counter(group.get_column("unavailable_reason").drop_nulls().to_list())
        stats: dict[str, Any] = {
            "observations": len(observed),
            "unavailable": values.null_count(),
            "latest_sample": latest["sample_id"],
            "latest": latest["value"],
            "latest_shape": latest["shape"],
            "dtype": latest["dtype"],
            "module_type": first_type[tuple(key)],
            "first_reason": min(reasons, key=lambda r: (-reasons[r], r)) if reasons else None,
            "reasons": len(reasons) or None,
        }
        if len(observed):
            stats |= {
                "mean": observed.mean(),
                "std": observed.std(),
                "min": observed.min(),
                "max": observed.max(),
                "p25": np.percentile(observed, 25),
                "p50": np.percentile(observed, 50),
                "p75": np.percentile(observed, 75),
                "recent_window_mean": observed[-window:].mean(),
                "previous_window_mean": (
                    observed[-2 * window : -window].mean() if len(observed) > window else None
                ),
            }
        out[tuple(key)] = stats
    return out


@pytest.mark.parametrize("shuffled", [False, True])
def test_measurements_in_many_partitions_equal_numpy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shuffled: bool
) -> None:
    """Every aggregate of every measurement, computed one partition at a time (about ten
    partitions here), equals numpy float64 over that measurement's rows in sample order;
    shapes, dtypes and module types come from the right rows."""
    path = tmp_path / "history.parquet"
    table = _history(path, 400, shuffled=shuffled)
    monkeypatch.setenv(PARTITION_ROWS_VARIABLE, str(MIN_PARTITION_ROWS))
    files = history_files(tmp_path)
    assert files.total_rows > 5 * MIN_PARTITION_ROWS, "vacuous: too few partitions"
    assert pq.read_metadata(path).num_row_groups > 5
    got, _ = aggregate_files(files, WINDOW)
    reference = _reference(table, WINDOW)
    assert got.height == len(reference) == 18
    for row in got.iter_rows(named=True):
        want = reference[tuple(row[k] for k in GROUP_KEYS)]
        for name, expected in want.items():
            if isinstance(expected, float | np.floating):
                assert row[name] == pytest.approx(float(expected), rel=1e-12, abs=1e-12), name
            else:
                assert row[name] == expected, (name, row[name], expected)


def test_many_partitions_give_the_bits_of_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With NaN and infinities among the values (where numpy's and Polars' quantiles part
    ways), the partitioned aggregation is bit for bit the one-partition one."""
    _history(tmp_path / "history.parquet", 300, shuffled=True, special=True, seed=5)
    files = history_files(tmp_path)
    whole, _ = aggregate_files(files, WINDOW)
    monkeypatch.setenv(PARTITION_ROWS_VARIABLE, str(MIN_PARTITION_ROWS))
    parts, _ = aggregate_files(files, WINDOW)
    order = list(GROUP_KEYS)
    assert whole.sort(order).equals(parts.sort(order), null_equal=True)
    assert whole.get_column("max").is_infinite().any(), "vacuous: no infinity"
    assert whole.get_column("mean").is_nan().any(), "vacuous: no NaN"


def _sink_run(directory: Path, s: Synth, samples: int) -> None:
    sink = DirectorySink(directory, history_config=HistoryConfig(window=WINDOW))
    sink.open(s.run)
    for sample in range(samples):
        sink.write_history(s.history(sample))
        if sample % 7 == 6:
            sink.flush()
    sink.close()


def test_summary_and_compare_read_the_same_in_many_partitions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, synth: Callable[..., Synth]
) -> None:
    """``ti summary`` and ``ti compare`` on runs read in many partitions (and compare's grid in
    many slices) give the tables they give in one."""
    first, second = tmp_path / "a", tmp_path / "b"
    _sink_run(first, synth(empty_every=3), 150)
    _sink_run(second, synth(seed=9), 140)
    whole = summary_table(first)
    compared = compare_runs([first, second], onset=60)
    monkeypatch.setenv(PARTITION_ROWS_VARIABLE, str(MIN_PARTITION_ROWS))
    monkeypatch.setattr(ALIGNMENT, "CELLS", 40)  # a few measurements per slice
    assert history_files(first).total_rows > 3 * MIN_PARTITION_ROWS
    assert summary_table(first).equals(whole, null_equal=True)
    again = compare_runs([first, second], onset=60)
    assert again.equals(compared, null_equal=True)
    assert compared.height == 2 * whole.filter(pl.col("executed")).height


def test_a_run_holding_two_rows_for_one_sample_is_refused_in_any_partition(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, synth: Callable[..., Synth]
) -> None:
    """Two rows of one measurement at one sample (two runs mixed in one directory) are named,
    whichever partition and slice they fall in."""
    first, second = tmp_path / "a", tmp_path / "b"
    s = synth()
    _sink_run(first, s, 30)
    sink = DirectorySink(second, history_config=HistoryConfig(window=WINDOW))
    sink.open(s.run)
    for sample in [*range(30), 17]:
        sink.write_history(s.history(sample))
    sink.close()
    monkeypatch.setenv(PARTITION_ROWS_VARIABLE, str(MIN_PARTITION_ROWS))
    monkeypatch.setattr(ALIGNMENT, "CELLS", 40)
    with pytest.raises(ValueError, match=r"holds 2 rows for one measurement at sample 17"):
        compare_runs([first, second])


def test_a_bad_partition_size_is_named(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    """``TI_IO_PARTITION_ROWS`` that is not a whole number of rows >= 1,000: one line naming
    the variable, no traceback."""
    _sink_run(tmp_path, synth(), 5)
    done = subprocess.run(
        [sys.executable, "-m", "ti_io.cli", "summary", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, PARTITION_ROWS_VARIABLE: "lots"},
        timeout=120,
    )
    assert done.returncode != 0
    assert "TI_IO_PARTITION_ROWS='lots'" in done.stderr
    assert "Traceback" not in done.stderr
