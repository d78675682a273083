"""``ti compare`` / ``compare_runs``: matched runs side by side, aligned by sample id.

The runs are real run directories written by ti-io's DirectorySink (finalized or live) from
rows whose values the tests choose, so every number in the table is checked against a numpy
float64 reference of those values.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from _io_helpers import NO_ROW, write_run

from ti_io.cli import main
from ti_io.read.compare import compare_runs, compare_series, open_runs, unshared
from ti_schema import SCHEMA_VERSION, SchemaMismatchError
from ti_schema.layout import HISTORY_FILE

SAMPLES = 10
ONSET = 4
rng = np.random.default_rng(7)
BASE_STD = list(rng.uniform(0.5, 0.7, SAMPLES))
BASE_GRAD = list(rng.uniform(1e-3, 2e-3, SAMPLES))


def three_runs(root: Path) -> dict[str, Path]:
    """baseline / broken / fixed: in broken, fc1's output std jumps x1000 from the onset and no
    gradient reaches fc1 any more (no rows); fixed equals baseline but for a small offset."""
    broken_std = [v * (1000.0 if i >= ONSET else 1.0) for i, v in enumerate(BASE_STD)]
    broken_grad = [v if i < ONSET else NO_ROW for i, v in enumerate(BASE_GRAD)]
    runs = {
        "baseline": {
            ("fc1", "output", "std"): BASE_STD,
            ("fc1", "output_gradient", "std"): BASE_GRAD,
            ("act", "output", "zero_fraction"): [0.5] * SAMPLES,
        },
        "broken": {
            ("fc1", "output", "std"): broken_std,
            ("fc1", "output_gradient", "std"): broken_grad,
            ("act", "output", "zero_fraction"): [0.5] * ONSET + [1.0] * (SAMPLES - ONSET),
        },
        "fixed": {
            ("fc1", "output", "std"): [v + 0.01 for v in BASE_STD],
            ("fc1", "output_gradient", "std"): BASE_GRAD,
            ("act", "output", "zero_fraction"): [0.5] * ONSET + [0.0] * (SAMPLES - ONSET),
        },
    }
    return {name: write_run(root / name, series) for name, series in runs.items()}


def row(table: pl.DataFrame, run: str, layer: str, signal: str, metric: str) -> dict[str, Any]:
    found = table.filter(
        (pl.col("run") == run)
        & (pl.col("layer") == layer)
        & (pl.col("signal") == signal)
        & (pl.col("metric") == metric)
    )
    assert found.height == 1, found
    return found.row(0, named=True)


def table_rows(text: str) -> list[list[str]]:
    """The body rows of a Polars table printed in ``text``, as lists of cell texts."""
    body = text.split("╞", 1)[1]  # below the header
    return [
        [cell.strip() for cell in line.strip().strip("│").split("┆")]
        for line in body.splitlines()
        if line.startswith("│")
    ]


def test_compare_runs_matches_a_numpy_reference(tmp_path: Path) -> None:
    runs = three_runs(tmp_path)
    table = compare_runs(runs, onset=ONSET, window=3)
    assert table.get_column("run").unique(maintain_order=True).to_list() == list(runs)
    assert table.height == 3 * 3  # three measurements, three runs, all shared
    assert table.get_column("in_run").all()

    broken_std = [v * (1000.0 if i >= ONSET else 1.0) for i, v in enumerate(BASE_STD)]
    for run, values in (("baseline", BASE_STD), ("broken", broken_std)):
        got = row(table, run, "fc1", "output", "std")
        assert (got["samples"], got["measured"], got["latest_sample"]) == (10, 10, 9)
        assert got["latest"] == values[-1]
        assert got["recent_window_mean"] == pytest.approx(np.mean(values[-3:]), rel=1e-12)
        assert got["previous_window_mean"] == pytest.approx(np.mean(values[-6:-3]), rel=1e-12)
        assert got["before_mean"] == pytest.approx(np.mean(values[:ONSET]), rel=1e-12)
        assert got["after_mean"] == pytest.approx(np.mean(values[ONSET:]), rel=1e-12)
        assert (got["samples_after"], got["measured_after"]) == (6, 6)
        for column, stat, reference in (
            ("latest_ratio", values[-1], BASE_STD[-1]),
            ("recent_ratio", np.mean(values[-3:]), np.mean(BASE_STD[-3:])),
            ("after_ratio", np.mean(values[ONSET:]), np.mean(BASE_STD[ONSET:])),
        ):
            assert got[column] == pytest.approx(stat / reference, rel=1e-12), (run, column)
    assert row(table, "broken", "fc1", "output", "std")["after_ratio"] == pytest.approx(1000.0)

    # The gradient that stops arriving: compared over the same ten samples, measured 4 of 10,
    # no latest value, no mean after the onset; never a zero.
    grad = row(table, "broken", "fc1", "output_gradient", "std")
    assert (grad["samples"], grad["measured"], grad["measured_after"]) == (10, 4, 0)
    assert grad["latest"] is None
    assert grad["after_mean"] is None
    assert grad["after_ratio"] is None
    assert grad["recent_window_mean"] is None
    assert grad["before_mean"] == pytest.approx(np.mean(BASE_GRAD[:ONSET]), rel=1e-12)

    # A reference of 0 gives no ratio (not infinity); the fix's zeros show in the values.
    fixed = row(table, "fixed", "act", "output", "zero_fraction")
    assert fixed["after_mean"] == 0.0
    assert fixed["after_ratio"] == 0.0
    broken_zero = row(table, "broken", "act", "output", "zero_fraction")
    assert broken_zero["after_ratio"] == 2.0
    assert unshared(table).height == 0


def test_compare_series_keeps_gaps_as_nulls(tmp_path: Path) -> None:
    runs = three_runs(tmp_path)
    series = compare_series(runs, layer="fc1", signal="output_gradient")
    assert series.height == 3 * SAMPLES
    broken = series.filter(pl.col("run") == "broken").sort("sample_id")
    assert broken.get_column("value").to_list()[:ONSET] == BASE_GRAD[:ONSET]
    assert broken.get_column("value").to_list()[ONSET:] == [None] * (SAMPLES - ONSET)
    # every sample keeps its root forward, also where the value is missing
    assert broken.get_column("forward_index").to_list() == [5 * s for s in range(SAMPLES)]


def test_runs_line_up_on_the_sample_ids_they_share(tmp_path: Path) -> None:
    """One run stopped early (crashed: live parts), another started later: only the shared
    samples are compared, and the latest sample is the last shared one."""
    values = [float(v) for v in range(12)]
    early = write_run(tmp_path / "early", {("fc1", "output", "mean"): values[:8]}, finalize=False)
    late = write_run(
        tmp_path / "late", {("fc1", "output", "mean"): values[2:]}, first_sample=2, window=2
    )
    opened = open_runs([early, late])
    assert [r.finalized for r in opened] == [False, True]
    assert opened[0].samples == tuple(range(8))
    table = compare_runs([early, late], window=2)
    for got in table.iter_rows(named=True):
        assert (got["samples"], got["latest_sample"]) == (6, 7)  # samples 2..7
        assert got["latest"] == 7.0
        assert got["recent_window_mean"] == pytest.approx(6.5)
        assert got["previous_window_mean"] == pytest.approx(4.5)


def test_different_layer_sets_are_listed_not_dropped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = write_run(
        tmp_path / "a",
        {("fc1", "output", "std"): [1.0, 2.0], ("old", "output", "std"): [3.0, 4.0]},
        layers=("fc1", "old"),
    )
    b = write_run(
        tmp_path / "b",
        {("fc1", "output", "std"): [2.0, 4.0], ("new", "output", "std"): [5.0, 6.0]},
        layers=("fc1", "new"),
    )
    table = compare_runs([a, b])
    assert table.height == 6  # fc1, old, new: each for both runs
    missing = table.filter(~pl.col("in_run")).select("layer", "run").sort("layer").rows()
    assert missing == [("new", "a"), ("old", "b")]
    lacking = unshared(table).select("layer", "in_runs", "missing_in").sort("layer").rows()
    assert lacking == [("new", ["b"], ["a"]), ("old", ["a"], ["b"])]
    assert row(table, "b", "fc1", "output", "std")["latest_ratio"] == 2.0

    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    shared, _, listed = out.partition("not in every run")
    assert {cells[0] for cells in table_rows(shared)} == {"fc1"}
    assert "2 measurements" in shared.splitlines()[-1]
    assert sorted((c[0], c[-2], c[-1]) for c in table_rows(listed)) == [
        ("new", "b", "a"),
        ("old", "a", "b"),
    ]


def _rewrite_contract(path: Path, version: str) -> None:
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    doc = json.loads(meta[b"ti"])
    doc["schema_version"] = version
    doc.pop("window", None)
    meta[b"ti"] = json.dumps(doc).encode()
    pq.write_table(table.replace_schema_metadata(meta), path)


def test_runs_of_different_contract_minors_compare_and_another_major_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = write_run(tmp_path / "new", {("fc1", "output", "std"): [1.0, 2.0]})
    old = write_run(tmp_path / "old", {("fc1", "output", "std"): [1.0, 4.0]})
    _rewrite_contract(old / HISTORY_FILE, "1.0")
    assert [r.contract_version for r in open_runs([new, old])] == [SCHEMA_VERSION, "1.0"]
    assert compare_runs([new, old]).get_column("latest").to_list() == [2.0, 4.0]
    assert main(["compare", str(new), str(old)]) == 0
    header = capsys.readouterr().out.splitlines()[:3]
    assert f"contract {SCHEMA_VERSION}" in header[1]
    assert "contract 1.0" in header[2]

    _rewrite_contract(old / HISTORY_FILE, "2.0")
    with pytest.raises(SchemaMismatchError, match=r"2\.0 cannot be read"):
        compare_runs([new, old])
    assert main(["compare", str(new), str(old)]) == 1
    assert "2.0 cannot be read" in capsys.readouterr().err


def test_bad_input_is_refused_with_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = write_run(tmp_path / "a", {("fc1", "output", "std"): [1.0, 2.0]})
    other = write_run(tmp_path / "other", {("conv", "output", "std"): [1.0]}, layers=("conv",))
    empty = tmp_path / "empty"
    empty.mkdir()
    ranks = tmp_path / "ranks"
    for rank in (0, 1):
        write_run(ranks / f"rank-00{rank}", {("fc1", "output", "std"): [1.0]})
    cases: list[tuple[list[str], int, str]] = [
        ([str(a), str(tmp_path / "missing")], 2, "missing: no such file or directory"),
        ([str(a)], 2, "compare two or more runs"),
        ([str(a), str(empty)], 1, "holds no history"),
        ([str(a), str(ranks)], 1, "compare one rank's directory"),
        ([str(a), str(other)], 1, "share no layer"),
        ([str(a), str(a)], 1, "twice"),
        ([str(a), str(ranks / "rank-000"), "--layer", "enc*"], 1, "matches no layer"),
        ([str(a), str(ranks / "rank-000"), "--metric", "median"], 1, "matches no metric"),
        ([str(a), str(ranks / "rank-000"), "--onset", "-1"], 2, "sample id"),
        ([str(a), str(ranks / "rank-000"), "--csv", "--json"], 2, "not allowed with"),
        ([str(a), str(ranks / "rank-000"), "--signal", "activations"], 2, "invalid choice"),
    ]
    for args, code, message in cases:
        assert main(["compare", *args]) == code, args
        out, err = capsys.readouterr()
        assert message in err, (args, err)
        assert "Traceback" not in err
        assert out == "", args
    with pytest.raises(FileNotFoundError, match="does not exist"):
        compare_runs([a, tmp_path / "missing"])
    with pytest.raises(ValueError, match="share no layer"):
        compare_runs({"a": a, "other": other})
    with pytest.raises(ValueError, match="two or more"):
        compare_runs([a])


def test_machine_output_is_the_frame(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = three_runs(tmp_path)
    args = ["compare", *map(str, runs.values()), "--onset", str(ONSET), "--window", "3"]
    frame = compare_runs(runs, onset=ONSET, window=3)
    assert main([*args, "--csv"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    from_csv = pl.read_csv(out.encode(), schema=frame.schema)
    # CSV cannot tell an empty string from a missing one: the bare-tensor path "" reads as null
    assert from_csv.with_columns(pl.col("tensor_path").fill_null("")).equals(frame)

    assert main([*args, "--json"]) == 0
    out, _ = capsys.readouterr()

    def refuse(token: str) -> float:
        raise AssertionError(f"not strict JSON: {token}")

    rows = json.loads(out, parse_constant=refuse)
    assert len(rows) == frame.height
    assert rows == frame.to_dicts()


def test_json_writes_non_finite_values_as_null(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A custom metric may hold NaN or infinity: strict JSON has no token for them."""
    a = write_run(tmp_path / "a", {("fc1", "output", "abs_max"): [1.0, math.inf]})
    b = write_run(tmp_path / "b", {("fc1", "output", "abs_max"): [2.0, math.nan]})
    frame = compare_runs([a, b], window=1)
    assert math.isinf(frame.item(0, "latest"))
    assert math.isnan(frame.item(1, "latest"))
    assert main(["compare", str(a), str(b), "--window", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["latest"] for r in rows] == [None, None]
    assert "before_mean" not in rows[0]  # the onset columns come with --onset only


def test_plot_draws_one_panel_per_measurement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.image as mpimg

    runs = three_runs(tmp_path)
    target = tmp_path / "out" / "compare.png"
    args = ["compare", *map(str, runs.values()), "--layer", "fc1", "--onset", str(ONSET)]
    assert main([*args, "--plot", str(target)]) == 0
    assert f"plot: {target}" in capsys.readouterr().out
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = mpimg.imread(target)
    assert image.shape[0] >= 2 * 250  # two panels: fc1 output std, fc1 output_gradient std
    assert image[..., :3].std() > 0.05, "the image is not blank"

    from ti_io.read.plot import plot_series

    series = compare_series(runs, layer="fc1", signal="output_gradient")
    figure_path = plot_series(series, tmp_path / "grad.png", onset=ONSET)
    assert figure_path.is_file()
    everything = [*args[:-4], "--plot", str(tmp_path / "all.png"), "--json"]  # 3 panels
    assert main(everything) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)) == 9  # stdout stays JSON
    assert f"plot: {tmp_path / 'all.png'}" in err


def test_plot_refuses_too_many_panels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    layers = [f"l{i}" for i in range(17)]
    series = {(layer, "output", "std"): [1.0, 2.0] for layer in layers}
    a = write_run(tmp_path / "a", series, layers=layers)
    b = write_run(tmp_path / "b", series, layers=layers)
    assert main(["compare", str(a), str(b), "--plot", str(tmp_path / "x.png")]) == 2
    assert "narrow them to at most 16" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    """matplotlib is the optional extra `plot`: without it, the command says how to get it."""
    runs = three_runs(tmp_path)
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # as if it were not installed\n"
        "from ti_io.cli import main\n"
        f"sys.exit(main(['compare', *{[str(p) for p in runs.values()]!r}, '--plot', 'x.png']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert done.returncode == 1, done.stderr
    assert 'pip install "ti-io[plot]"' in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "x.png").exists()
