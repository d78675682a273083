"""Run directories in torchinstruments 0.8.0's layout: recognized by every ``ti`` command and
converted by ``ti upgrade`` / ``ti_io.upgrade`` (Parquet and JSON only, no torch).

The directories here are built with 0.8.0's file layout (its twelve history columns as Polars
writes them, no ``ti`` footer; result.json records as its catalog; index.md with its sampling,
rank and window lines). tests/test_legacy_080.py does the same with runs written by the real
torchinstruments 0.8.0.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ti_io import LegacyRunError, UpgradeError, consolidate, legacy_reason, upgrade, validate_run
from ti_io.cli import main
from ti_io.integrity import verify_parquet
from ti_io.read.legacy_layout import LEGACY_COLUMNS
from ti_schema import DEFAULT_METRICS, parse_metadata
from ti_schema.legacy_paths import modern_path
from ti_schema.testing import assert_artifact_dir_conforms, example_history_table

LAYERS = (
    ("enc.0", "Linear", ("output",)),
    ("enc.1", "Encoder.Block", ("output.aux.0", "output.main")),
)
START = datetime(2025, 6, 1, tzinfo=UTC)


def legacy_table(samples: int, seed: int = 0) -> pa.Table:
    """Rows as 0.8.0's ParquetHistory wrote them: '' reasons for values, nulls with a reason."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list[Any]] = {c: [] for c in LEGACY_COLUMNS}
    for sample in range(samples):
        for signal, prefix in (("output", "output"), ("output_gradient", "grad_output")):
            for layer, _, paths in LAYERS:
                for path in paths:
                    for metric in DEFAULT_METRICS:
                        missing = layer == "enc.1" and sample % 7 == 3 and metric == "p50"
                        rows["layer"].append(layer)
                        rows["call_index"].append(0)
                        rows["signal"].append(signal)
                        rows["tensor_path"].append(path.replace("output", prefix, 1))
                        rows["sample_id"].append(sample)
                        rows["forward_index"].append(10 * sample + 9)
                        rows["timestamp"].append(START + timedelta(seconds=sample))
                        rows["shape"].append([4, 3])
                        rows["dtype"].append("float32")
                        rows["metric"].append(metric)
                        rows["value"].append(None if missing else float(rng.normal()))
                        rows["unavailable_reason"].append("empty tensor" if missing else "")
    schema = pa.schema(
        [
            ("layer", pa.large_string()),
            ("call_index", pa.int64()),
            ("signal", pa.large_string()),
            ("tensor_path", pa.large_string()),
            ("sample_id", pa.int64()),
            ("forward_index", pa.int64()),
            ("timestamp", pa.timestamp("us", tz="UTC")),
            ("shape", pa.large_list(pa.int64())),
            ("dtype", pa.large_string()),
            ("metric", pa.large_string()),
            ("value", pa.float64()),
            ("unavailable_reason", pa.large_string()),
        ]
    )
    return pa.table(rows, schema=schema)


def write_legacy_run(
    directory: Path,
    samples: int = 25,
    *,
    window: int = 20,
    interrupted: bool = False,
    rank: tuple[int, int] | None = (0, 1),
) -> pa.Table:
    directory.mkdir(parents=True)
    table = legacy_table(samples)
    if interrupted:  # 0.8.0's history.parts/: an empty first chunk, then one per sample
        parts = directory / "history.parts"
        parts.mkdir()
        pq.write_table(table.slice(0, 0), parts / "00000000.parquet")
        per = table.num_rows // samples
        for i in range(samples):
            pq.write_table(table.slice(i * per, per), parts / f"{i + 1:08d}.parquet")
    else:
        pq.write_table(table, directory / "history.parquet", compression="zstd")
    catalog = [
        {"layer": name, "type": kind, "aliases": [name], "tensors": []} for name, kind, _ in LAYERS
    ]
    (directory / "result.json").write_text(json.dumps(catalog, indent=2))
    rank_line = f" Rank: {rank[0]}/{rank[1]}." if rank else ""
    (directory / "index.md").write_text(
        "# Model measurements\n\nThe recent window contains at most "
        f"{window} observations; the previous window contains\n...\n\n## Collection\n\n"
        f"Sampling: every_n_forwards {{'n': 10}}.{rank_line}\n"
        "Forward samples: 1; backward samples: 1.\nHistogram layers: ('enc.0',).\n"
    )
    (directory / "tensorboard").mkdir()
    (directory / "tensorboard" / "events.out.tfevents.1.host.1.0").write_bytes(b"\x00event")
    return table


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("output", ""),
        ("grad_output", ""),
        ("output.0", "[0]"),
        ("output.aux.0", "['aux'][0]"),
        ("grad_output.aux.0", "['aux'][0]"),
        ("output.logits", "['logits']"),
        ("output.-1", "[-1]"),
        ("something", "something"),
    ],
)
def test_tensor_paths_are_respelled(old: str, new: str) -> None:
    assert modern_path(old) == new


def test_every_command_recognizes_a_0_8_0_run_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "old"
    write_legacy_run(old)
    interrupted = tmp_path / "crashed"
    write_legacy_run(interrupted, interrupted=True)
    before = sorted(p.name for p in (interrupted / "history.parts").iterdir())
    for args in (["summary", old], ["validate", old], ["consolidate", interrupted]):
        assert main([str(a) for a in args]) == 1
        out, err = capsys.readouterr()
        assert out == ""
        assert len(err.strip().splitlines()) == 1, err
        assert "written by torchinstruments 0.8.0" in err
        assert f"ti upgrade {args[1]} NEW_DIR" in err
        assert "Traceback" not in err
    with pytest.raises(LegacyRunError, match="so it cannot be consolidated; convert it with"):
        consolidate(interrupted)
    # the 0.8.0 parts were left exactly as they were
    assert sorted(p.name for p in (interrupted / "history.parts").iterdir()) == before
    assert legacy_reason(tmp_path / "old") is not None
    current = tmp_path / "current"
    current.mkdir()
    pq.write_table(example_history_table(20), current / "history.parquet")
    assert legacy_reason(current) is None


def test_upgrade_gives_a_valid_run_with_the_same_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    legacy = pl.from_arrow(write_legacy_run(old, samples=25, window=20))
    assert isinstance(legacy, pl.DataFrame)
    assert main(["upgrade", str(old), str(new)]) == 0
    assert "upgraded the torchinstruments 0.8.0 run" in capsys.readouterr().out
    assert main(["validate", str(new)]) == 0
    assert capsys.readouterr().out.strip() == "ok"
    assert_artifact_dir_conforms(new)
    assert main(["summary", str(new), "--metric", "mean"]) == 0
    summary = capsys.readouterr().out
    assert "upgraded from torchinstruments 0.8.0" in summary
    assert "window 20" in summary

    history = pl.read_parquet(new / "history.parquet")
    assert history.height == legacy.height
    footer = parse_metadata(pq.read_metadata(new / "history.parquet").metadata)
    assert footer["upgraded_from"] == "torchinstruments 0.8.0"
    assert footer["unrecorded"] == ["run_id", "mode", "grad_enabled"]
    assert footer["window"] == 20
    assert history["run_id"].n_unique() == 1
    assert history["rank"].unique().to_list() == [0]
    assert history["mode"].unique().to_list() == ["train"]
    assert dict(history.select("layer", "module_type").unique().iter_rows()) == {
        "enc.0": "Linear",
        "enc.1": "Block",  # 0.8.0 wrote the __qualname__
    }
    assert sorted(history["tensor_path"].unique().to_list()) == ["", "['aux'][0]", "['main']"]
    # available values carry a null reason now, missing ones keep 0.8.0's reason
    assert history.filter(pl.col("value").is_null())["unavailable_reason"].unique().to_list() == [
        "empty tensor"
    ]
    assert history.filter(pl.col("value").is_not_null())["unavailable_reason"].null_count() == (
        history["value"].count()
    )
    # result.json from the upgraded history: numpy float64, partial windows of 20
    records = {r["layer"]: r for r in json.loads((new / "result.json").read_text())}
    assert records["enc.1"]["aliases"] == []
    tensor = next(
        t
        for t in records["enc.1"]["tensors"]
        if t["signal"] == "output_gradient" and t["tensor_path"] == "['aux'][0]"
    )
    for metric in ("mean", "p50"):
        values = (
            legacy.filter(
                (pl.col("layer") == "enc.1")
                & (pl.col("tensor_path") == "grad_output.aux.0")
                & (pl.col("metric") == metric)
            )
            .sort("sample_id")["value"]
            .drop_nulls()
            .to_numpy()
        )
        stats = tensor["statistics"][metric]
        assert stats["observations"] == len(values)
        assert stats["mean"] == pytest.approx(values.mean(), rel=1e-12)
        assert stats["p25"] == pytest.approx(np.percentile(values, 25), rel=1e-12)
        assert stats["recent_window_mean"] == pytest.approx(values[-20:].mean(), rel=1e-12)
        assert stats["previous_window_mean"] == pytest.approx(values[:-20].mean(), rel=1e-12)
    assert (new / "tensorboard" / "events.out.tfevents.1.host.1.0").read_bytes() == b"\x00event"
    # the same old files give the same run id
    again = tmp_path / "again"
    upgrade(old, again)
    assert pl.read_parquet(again / "history.parquet")["run_id"][0] == history["run_id"][0]


def test_upgrade_of_an_interrupted_run_and_of_rank_directories(tmp_path: Path) -> None:
    crashed = tmp_path / "crashed"
    table = write_legacy_run(crashed, samples=4, interrupted=True)
    done = upgrade(crashed, tmp_path / "crashed-new")
    (run,) = done.runs
    assert run.interrupted
    assert run.history_rows == table.num_rows
    assert_artifact_dir_conforms(tmp_path / "crashed-new")

    ranks = tmp_path / "ranks"
    write_legacy_run(ranks / "rank-000", samples=3, rank=(0, 2))
    write_legacy_run(ranks / "rank-001", samples=3, rank=None)  # no Rank: line
    assert legacy_reason(ranks) is not None
    done = upgrade(ranks, tmp_path / "ranks-new")
    assert [(r.destination.name, r.rank) for r in done.runs] == [("rank-000", 0), ("rank-001", 1)]
    assert_artifact_dir_conforms(tmp_path / "ranks-new")
    for rank in (0, 1):
        history = pl.read_parquet(tmp_path / "ranks-new" / f"rank-00{rank}" / "history.parquet")
        assert history["rank"].unique().to_list() == [rank]


def test_a_bad_or_foreign_directory_is_refused_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "old"
    write_legacy_run(old, samples=2)
    current = tmp_path / "current"
    current.mkdir()
    pq.write_table(example_history_table(20), current / "history.parquet")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    pq.write_table(pa.table({"a": [1, 2]}), foreign / "history.parquet")
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    # (source, target, what upgrade() says, the command's exit code and words): a path that
    # does not exist is a usage error (2), a refused directory exits 1.
    cases = [
        (tmp_path / "missing", tmp_path / "out", "is not a directory", 2, "no such file"),
        (foreign, tmp_path / "out", "holds no torchinstruments 0.8.0 run", 1, None),
        (current, tmp_path / "out", "already a run of the current contract", 1, None),
        (old, occupied, "already exists and is not empty", 1, None),
        (old, old / "inside", "inside", 1, None),
    ]
    listing = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for source, target, message, code, said in cases:
        with pytest.raises(UpgradeError, match=message):
            upgrade(source, target)
        assert main(["upgrade", str(source), str(target)]) == code
        _, err = capsys.readouterr()
        assert len(err.strip().splitlines()) == 1
        assert (said or message) in err
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == listing

    # a 0.8.0 file that breaks midway: the error surfaces, and no partial run is left behind
    broken = tmp_path / "broken"
    write_legacy_run(broken, samples=3, interrupted=True)
    (broken / "history.parts" / "00000002.parquet").write_bytes(b"PAR1 not parquet")
    listing = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(UpgradeError, match=r"cannot read .*00000002\.parquet as Parquet"):
        upgrade(broken, tmp_path / "broken-new")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == listing


def test_upgrade_reports_progress_in_history_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``upgrade(progress=...)`` counts converted history rows up to the total of every rank's
    files; ``ti upgrade --progress`` draws it on stderr, never on stdout."""
    old = tmp_path / "old"
    rows = [write_legacy_run(old / f"rank-00{r}", samples=6, interrupted=r == 1) for r in (0, 1)]
    total = sum(t.num_rows for t in rows)
    seen: list[tuple[int, int]] = []
    upgrade(old, tmp_path / "new", progress=lambda done, of: seen.append((done, of)))
    assert seen[-1] == (total, total)
    assert all(of == total for _, of in seen)
    assert [done for done, _ in seen] == sorted({done for done, _ in seen})  # only grows
    assert len(seen) > 2  # the interrupted rank reports part by part

    assert main(["upgrade", str(old), str(tmp_path / "again"), "--progress"]) == 0
    out, err = capsys.readouterr()
    assert "upgrading" in err
    assert "upgrading" not in out
    assert out.count("upgraded the torchinstruments 0.8.0") == 2


def test_the_upgraded_run_carries_page_checksums(tmp_path: Path) -> None:
    """0.8.0 wrote no page checksums (read unverified); what upgrade writes has them."""
    old, new = tmp_path / "old", tmp_path / "new"
    write_legacy_run(old, samples=5)
    assert not verify_parquet(old / "history.parquet").checksummed
    upgrade(old, new)
    assert verify_parquet(new / "history.parquet").checksummed
    found = validate_run(new)
    assert found.ok, found.problems
    assert found.unverified == ()
