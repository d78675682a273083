"""``ti report`` / ``write_report``: the page's numbers, its safety and its refusals.

Runs are real run directories written by ti-io's DirectorySink from values the tests choose, so
every cell of a heat map, every window mean and every ratio is checked against numpy float64.
The page is opened in a real browser by tests/test_report_browser.py.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from _event_helpers import event_batch
from _io_helpers import NO_ROW, make_run, write_run

from ti_io import DirectorySink
from ti_io.cli import main
from ti_io.read.compare import compare_runs, open_runs
from ti_io.read.history import history_files_of
from ti_io.report import write_report
from ti_io.report.figures import ColourScale, panel_figure, ratio_figure
from ti_io.report.grid import read_grid
from ti_schema import DEFAULT_METRICS
from ti_schema.layout import HISTORY_FILE

SAMPLES = 30
rng = np.random.default_rng(3)
STD = {layer: list(rng.uniform(0.5, 1.5, SAMPLES)) for layer in ("fc1", "act", "fc2")}
GRAD = {layer: list(rng.uniform(1e-4, 1e-2, SAMPLES)) for layer in ("fc1", "act", "fc2")}
HOSTILE = "<img src=x onerror=alert(1)>"


def _series(scale: float = 1.0, dead_from: int | None = None) -> dict:
    series: dict = {}
    for layer in STD:
        series[(layer, "output", "std")] = [v * scale for v in STD[layer]]
        grads: list = list(GRAD[layer])
        if dead_from is not None and layer == "fc1":
            grads = [v if i < dead_from else NO_ROW for i, v in enumerate(grads)]
        series[(layer, "output_gradient", "std")] = grads
        series[(layer, "output", "nonfinite_fraction")] = [0.0] * SAMPLES
    return series


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return write_run(tmp_path / "baseline", _series(), window=5)


def test_each_cell_is_the_mean_min_and_max_of_its_samples(run: Path) -> None:
    opened = open_runs([run], minimum=1)[0]
    grid = read_grid(
        history_files_of(run),
        opened.samples,
        [("output", "std"), ("output_gradient", "std")],
        columns=7,
        window=5,
        order=["fc1", "act", "fc2"],
    )
    panel = grid.panels[("output", "std")]
    assert panel.tensors.get_column("layer").to_list() == ["fc1", "act", "fc2"]
    # 30 samples in 7 columns of consecutive samples, equal in size to within one
    edges = [(c * SAMPLES + 6) // 7 for c in range(8)]
    assert grid.column_samples.tolist() == edges[:-1]
    for row, layer in enumerate(("fc1", "act", "fc2")):
        values = np.asarray(STD[layer], dtype=np.float64)
        for column in range(7):
            cell = values[edges[column] : edges[column + 1]]
            assert panel.mean[row, column] == pytest.approx(cell.mean(), rel=1e-12)
            assert panel.low[row, column] == cell.min()
            assert panel.high[row, column] == cell.max()
        stats = panel.tensors.row(row, named=True)
        assert stats["latest"] == values[-1]
        assert stats["latest_sample"] == SAMPLES - 1
        assert stats["recent_window_mean"] == pytest.approx(values[-5:].mean(), rel=1e-12)
        assert stats["previous_window_mean"] == pytest.approx(values[-10:-5].mean(), rel=1e-12)
    assert panel.nonzero
    # sample s was taken at root forward 5 s: an event at forward 17 lies at sample 3
    assert grid.sample_at_forward(17) == 3
    assert grid.sample_at_forward(-1) is None


def test_latest_and_window_means_are_result_jsons_nan_included(tmp_path: Path) -> None:
    """The per-layer numbers are result.json's: window means over each tensor's last
    observations (a tensor recorded every third sample has windows of observations, not of
    samples), and a NaN at the end shows as NaN, never hidden by the finite ones."""
    values = list(STD["fc1"])
    series = {
        ("fc1", "output", "std"): [*values[:-2], math.nan, math.nan],
        ("fc2", "output", "std"): [v if i % 3 == 0 else NO_ROW for i, v in enumerate(values)],
        ("act", "output", "std"): values,
    }
    run = write_run(tmp_path / "run", series, window=4)
    opened = open_runs([run], minimum=1)[0]
    grid = read_grid(
        history_files_of(run), opened.samples, [("output", "std")], columns=7, window=4
    )
    tensors = grid.panels[("output", "std")].tensors
    records = json.loads((run / "result.json").read_text(encoding="utf-8"))
    for record in records:
        row = tensors.filter(pl.col("layer") == record["layer"]).row(0, named=True)
        expected = record["tensors"][0]["statistics"]["std"]
        for key in ("recent_window_mean", "previous_window_mean"):
            if expected[key] is None and row[key] is not None:
                assert math.isnan(row[key]), (record["layer"], key)  # JSON has no NaN
            else:
                assert row[key] == pytest.approx(expected[key], rel=1e-12), (record["layer"], key)
    fc1 = tensors.filter(pl.col("layer") == "fc1").row(0, named=True)
    assert math.isnan(fc1["latest"])
    assert math.isnan(fc1["recent_window_mean"])
    fc2 = tensors.filter(pl.col("layer") == "fc2").row(0, named=True)
    every_third = np.asarray(values[::3])
    assert fc2["recent_window_mean"] == pytest.approx(every_third[-4:].mean(), rel=1e-12)
    page = write_report(run, tmp_path / "r.html").read_text(encoding="utf-8")
    assert "<span class='bad'>nan</span>" in page


def test_a_part_published_after_the_samples_were_listed_is_left_out(tmp_path: Path) -> None:
    """A live run publishes parts while it is read: rows of samples not in the list read
    first are left out (as if read a moment earlier), not a crash or a wrong column."""
    live = write_run(tmp_path / "live", _series(), finalize=False)
    opened = open_runs([live], minimum=1)[0]
    earlier = opened.samples[:-3]
    grid = read_grid(history_files_of(live), earlier, [("output", "std")], columns=400, window=5)
    panel = grid.panels[("output", "std")]
    assert panel.mean.shape == (3, SAMPLES - 3)
    assert panel.tensors.get_column("latest_sample").max() == SAMPLES - 4


def test_more_columns_than_samples_gives_one_column_per_sample(run: Path) -> None:
    opened = open_runs([run], minimum=1)[0]
    grid = read_grid(
        history_files_of(run), opened.samples, [("output", "std")], columns=400, window=5
    )
    panel = grid.panels[("output", "std")]
    assert panel.mean.shape == (3, SAMPLES)
    fc1 = panel.tensors.get_column("layer").to_list().index("fc1")
    np.testing.assert_array_equal(panel.mean[fc1], np.asarray(STD["fc1"]))


def test_a_run_that_stops_recording_shows_gaps_not_zeros(tmp_path: Path) -> None:
    broken = write_run(tmp_path / "broken", _series(dead_from=12), window=5)
    opened = open_runs([broken], minimum=1)[0]
    grid = read_grid(
        history_files_of(broken),
        opened.samples,
        [("output_gradient", "std")],
        columns=400,
        window=5,
    )
    panel = grid.panels[("output_gradient", "std")]
    fc1 = panel.tensors.get_column("layer").to_list().index("fc1")
    assert np.isnan(panel.mean[fc1, 12:]).all()
    np.testing.assert_array_equal(panel.mean[fc1, :12], np.asarray(GRAD["fc1"][:12]))
    # result.json's window: its last 5 observations (samples 7..11), not the run's last samples
    recent = panel.tensors.row(fc1, named=True)["recent_window_mean"]
    assert recent == pytest.approx(np.mean(GRAD["fc1"][7:12]), rel=1e-12)
    page = write_report(broken, tmp_path / "r.html").read_text(encoding="utf-8")
    assert page.count("(sample 11)") == 1  # fc1's gradient: its latest value, and when


def _figure_json(page: str, div_id: str) -> dict:
    """The data and layout Plotly.newPlot receives for ``div_id``."""
    start = page.index(f'Plotly.newPlot(                        "{div_id}",')
    decoder = json.JSONDecoder()
    rest = page[page.index("[", start) :]
    data, end = decoder.raw_decode(rest)
    layout, _ = decoder.raw_decode(rest[end:].lstrip(", \n"))
    return {"data": data, "layout": layout}


def _decoded(array: dict | list) -> np.ndarray:
    if isinstance(array, list):
        return np.asarray(array, dtype=np.float64)
    import base64

    raw = np.frombuffer(base64.b64decode(array["bdata"]), dtype=np.dtype(array["dtype"]))
    shape = [int(n) for n in str(array.get("shape", raw.size)).split(",")]
    return raw.reshape(shape).astype(np.float64)


def test_the_page_is_self_contained_and_holds_the_runs_numbers(tmp_path: Path) -> None:
    baseline = write_run(tmp_path / "baseline", _series(), window=5)
    events = [event_batch(0, forward_index=5 * 12 + 2, layers=("fc1",), types=("Linear",))]
    broken = write_run(tmp_path / "broken", _series(scale=1000.0), window=5, events=events)
    page_path = write_report([baseline, broken], tmp_path / "report.html")
    page = page_path.read_text(encoding="utf-8")
    assert page_path.stat().st_size < 10_000_000
    # nothing fetched: no external script, style, image or font
    assert not re.search(r"""<(script|link|img|iframe)[^>]+(src|href)=["']?(https?:)?//""", page)
    from plotly.offline import get_plotlyjs

    assert get_plotlyjs() in page  # plotly.js inlined whole, once
    assert page.count(get_plotlyjs()[:200]) == 1
    for name in ("fc1", "act", "fc2", "baseline", "broken"):
        assert name in page
    figure = _figure_json(page, "panel-0")
    layout = figure["layout"]
    heat = [trace for trace in figure["data"] if trace["type"] == "heatmap"]
    assert len(heat) == 2  # side by side
    assert {trace["coloraxis"] for trace in heat} == {"coloraxis"}  # one colour scale
    # std spans 0.5 .. 1500: more than 20x, so log10 colours on one shared scale
    assert layout["coloraxis"]["cmin"] == pytest.approx(
        math.log10(min(min(v) for v in STD.values())), rel=1e-6
    )
    assert layout["coloraxis"]["cmax"] == pytest.approx(
        math.log10(1000.0 * max(max(v) for v in STD.values())), rel=1e-6
    )
    custom = _decoded(heat[1]["customdata"])
    assert custom.shape == (3, SAMPLES, 3)
    rows = heat[1]["y"]
    fc2 = rows.index("fc2")
    np.testing.assert_allclose(custom[fc2, :, 0], 1000.0 * np.asarray(STD["fc2"]), rtol=1e-6)
    # columns are given by their edges, so a column spans its samples exactly; the event is a
    # mark at the sample taken at or before its forward (62 -> sample 12)
    assert _decoded(heat[1]["x"]).tolist() == list(range(SAMPLES + 1))
    lines = [shape for shape in layout.get("shapes", []) if shape["type"] == "line"]
    assert [line["x0"] for line in lines] == [12]
    assert any("nonfinite" in note["text"] for note in layout["annotations"])
    # the ratio view holds ti compare's recent_ratio
    ratios = _figure_json(page, "ratios")
    table = compare_runs({"baseline": baseline, "broken": broken}, signal="output", metric="std")
    trace = ratios["data"][0]
    shown = _decoded(trace["customdata"])[:, 0]
    expected = dict(
        zip(
            table.filter(pl.col("run") == "broken").get_column("layer").to_list(),
            table.filter(pl.col("run") == "broken").get_column("recent_ratio").to_list(),
            strict=True,
        )
    )
    for label, value in zip(trace["y"], shown, strict=True):
        assert value == pytest.approx(expected[label], rel=1e-6)
        assert value == pytest.approx(1000.0, rel=1e-6)
    # the nonfinite_fraction panel stayed 0 in every run: not drawn
    assert "output nonfinite_fraction" not in page


def test_nonfinite_fraction_is_drawn_once_a_value_is_not_zero(tmp_path: Path) -> None:
    series = _series()
    series[("act", "output", "nonfinite_fraction")] = [0.0] * 20 + [0.25] * 10
    page = write_report(write_run(tmp_path / "a", series), tmp_path / "r.html").read_text()
    assert "output nonfinite_fraction" in page


def test_precision_health_is_drawn_where_a_cast_would_lose_entries(tmp_path: Path) -> None:
    """A run recording precision metrics (``precision=("bfloat16",)``): the heat map of a
    format's fraction appears once any entry would underflow, and not while none would."""
    formats = ("underflow_fraction.bfloat16", "overflow_fraction.bfloat16")
    series = _series()
    series[("fc2", "output_gradient", "underflow_fraction.bfloat16")] = [0.0] * 25 + [0.5] * 5
    series[("fc2", "output_gradient", "overflow_fraction.bfloat16")] = [0.0] * SAMPLES
    run = write_run(tmp_path / "bf16", series, metrics=(*DEFAULT_METRICS, *formats))
    page = write_report(run, tmp_path / "r.html").read_text(encoding="utf-8")
    assert "<h2>output_gradient underflow_fraction.bfloat16</h2>" in page
    assert "overflow_fraction.bfloat16</h2>" not in page
    figure = _figure_json(page, "panel-2")
    assert figure["layout"]["title"]["text"] == "output_gradient underflow_fraction.bfloat16"
    values = _decoded(figure["data"][0]["customdata"])[0, :, 0]
    np.testing.assert_array_equal(values, [0.0] * 25 + [0.5] * 5)


def test_colour_scale_is_linear_within_20x_and_log_beyond() -> None:
    assert not ColourScale.of([np.array([[0.5, 2.0, np.nan]])]).log
    assert not ColourScale.of([np.array([[1.0]]), np.array([[20.0]])]).log
    assert ColourScale.of([np.array([[1.0]]), np.array([[20.5]])]).log
    wide = ColourScale.of([np.array([[0.0, 1e-6, 1.0]])])
    assert wide.log
    assert wide.low == pytest.approx(-6.0)
    assert wide.high == pytest.approx(0.0)
    # a zero shows at the bottom of the scale, not as a gap
    assert wide.colour(np.array([0.0]))[0] == pytest.approx(-6.0)
    assert not ColourScale.of([np.array([[-1.0, 1e-6, 1e3]])]).log  # signs: linear


def test_names_from_a_run_are_text_never_markup(tmp_path: Path) -> None:
    layers = ("fc1", HOSTILE, "fc2")
    series = {(layer, "output", "std"): STD["fc1"] for layer in layers}
    events = [
        event_batch(
            0,
            kind="manual",
            forward_index=20,
            reason="</script><script>alert(2)</script>",
        )
    ]
    run = write_run(tmp_path / "run", series, layers=layers, events=events)
    page = write_report(run, tmp_path / "r.html").read_text(encoding="utf-8")
    body = page[page.index("</head>") :]
    assert "<img" not in body
    assert "<script>alert" not in body
    assert "&lt;img src=x onerror=alert(1)&gt;" in body  # our table: escaped text
    figure = _figure_json(page, "panel-0")
    labels = figure["data"][0]["y"]
    assert "&lt;img src=x onerror=alert(1)&gt;" in labels  # Plotly shows entities as text
    # inside Plotly's JSON, < > / are escaped too: no string can close the script
    script = page[page.index("panel-0") :]
    script = script[: script.index("</script>")]
    assert "<" not in script.split("Plotly.newPlot", 1)[1]


def test_a_live_run_is_reported_from_its_parts(tmp_path: Path) -> None:
    live = write_run(tmp_path / "live", _series(), finalize=False)
    assert not (live / HISTORY_FILE).exists()
    page = write_report(live, tmp_path / "r.html").read_text(encoding="utf-8")
    assert "live or unconsolidated" in page
    assert "fc1" in page


def test_a_live_run_without_a_part_yet_is_refused_with_why(tmp_path: Path) -> None:
    sink = DirectorySink(tmp_path / "starting")
    sink.open(make_run((("fc1", "Linear"),)))  # run.json written, no part published yet
    with pytest.raises(ValueError, match="starting: no sample yet"):
        write_report(tmp_path / "starting", tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()
    sink.close()


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_writes_the_page_and_says_where(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = write_run(tmp_path / "other", _series(scale=2.0), window=5)
    out = tmp_path / "page.html"
    code, stdout, stderr = _cli(
        capsys, "report", str(run), str(other), "-o", str(out), "--metric", "std"
    )
    assert (code, stderr) == (0, "")
    assert str(out) in stdout
    assert out.is_file()
    page = out.read_text(encoding="utf-8")
    assert "output_gradient std" in page
    assert "ratio to baseline" in page


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--metric", "stdd"], "--metric 'stdd': no run records such a metric"),
        (["--layer", "enc*"], "--layer 'enc*' matches no layer"),
        (["--signal", "parameter"], "no run holds parameter std"),
        (["-o", "{tmp}/page.png"], "the report is an HTML file"),
        (["-o", "{tmp}/missing/page.html"], "not a file in an existing directory"),
    ],
)
def test_bad_input_is_one_line_and_no_file(
    run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "-o" not in args:
        args += ["-o", str(tmp_path / "page.html")]
    code, stdout, stderr = _cli(capsys, "report", str(run), *args)
    assert code != 0
    assert stdout == ""
    assert message in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert list(tmp_path.glob("*.htm*")) == []
    assert list(tmp_path.glob(".*tmp")) == []


def test_a_directory_that_is_not_a_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes").mkdir()
    code, _, stderr = _cli(
        capsys, "report", str(tmp_path / "notes"), "-o", str(tmp_path / "r.html")
    )
    assert code != 0
    assert "holds no history" in stderr
    assert not (tmp_path / "r.html").exists()


def test_a_run_of_a_newer_contract_is_refused(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = run / HISTORY_FILE
    table = pq.read_table(path)
    metadata = dict(table.schema.metadata)
    ti = json.loads(metadata[b"ti"])
    ti["schema_version"] = "9.0"
    metadata[b"ti"] = json.dumps(ti).encode()
    pq.write_table(table.replace_schema_metadata(metadata), path)
    code, _, stderr = _cli(capsys, "report", str(run), "-o", str(tmp_path / "r.html"))
    assert code != 0
    assert "9.0" in stderr
    assert not (tmp_path / "r.html").exists()


def test_without_plotly_the_error_names_the_extra(run: Path, tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['plotly'] = None; from ti_io.cli import main; "
        f"sys.exit(main(['report', {str(run)!r}, '-o', {str(tmp_path / 'r.html')!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0
    assert 'pip install "ti-io[report]"' in done.stderr
    assert not (tmp_path / "r.html").exists()


def test_layer_names_are_names_not_patterns_in_the_ratio_view(tmp_path: Path) -> None:
    layers = ("head[0]", "fc*")
    series = {(layer, "output", "std"): STD["fc1"] for layer in layers}
    a = write_run(tmp_path / "a", series, layers=layers)
    b = write_run(
        tmp_path / "b", {k: [2 * v for v in vs] for k, vs in series.items()}, layers=layers
    )
    page = write_report([a, b], tmp_path / "r.html", layers=["head[[]0]", "fc[*]"])
    text = page.read_text(encoding="utf-8")
    ratios = _figure_json(text, "ratios")["data"][0]
    assert sorted(ratios["y"]) == ["fc*", "head[0]"]
    np.testing.assert_allclose(_decoded(ratios["customdata"])[:, 0], 2.0, rtol=1e-6)


def test_the_ratio_figure_centres_on_one(run: Path, tmp_path: Path) -> None:
    other = write_run(tmp_path / "x2", _series(scale=2.0), window=5)
    table = compare_runs({"a": run, "b": other}, signal="output", metric="std")
    figure = ratio_figure(table, [("output", "std")], "a")
    z = np.asarray(figure.data[0].z, dtype=np.float64)
    np.testing.assert_allclose(z, 1.0, rtol=1e-6)  # log2(2)
    assert figure.layout.coloraxis.cmid == 0.0


def test_panel_figure_keeps_rows_a_run_lacks(run: Path, tmp_path: Path) -> None:
    series = {k: v for k, v in _series().items() if k[0] != "act"}
    short = write_run(tmp_path / "short", series, layers=("fc1", "fc2"), window=5)
    grids = []
    for directory in (run, short):
        opened = open_runs([directory], minimum=1)[0]
        grids.append(
            (
                directory.name,
                read_grid(
                    history_files_of(directory),
                    opened.samples,
                    [("output", "std")],
                    columns=400,
                    window=5,
                    order=["fc1", "act", "fc2"],
                ),
            )
        )
    figure = panel_figure(("output", "std"), grids, [[], []])
    assert list(figure.data[0].y) == list(figure.data[1].y) == ["fc1", "act", "fc2"]
    assert np.isnan(np.asarray(figure.data[1].z, dtype=np.float64)[1]).all()
