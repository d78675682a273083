"""``ti report`` pages opened in a real browser: headless Chromium (Debian's ``chromium``) driven
by Playwright, started and stopped by each test.

The page of a real experiment (ti-examples' detached branch: baseline, broken and fixed runs
trained here) must draw every plot with no script error, name every layer and not be blank;
a run whose names are markup must show them as text and run nothing. With
``TI_REPORT_SCREENSHOT=docs/report.png`` the experiment's screenshot is kept there (the one
README.md shows).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib.image as mpimg
import numpy as np
import pyarrow as pa
import pytest

from ti_examples.experiments import run_problem
from ti_examples.problems import PROBLEMS
from ti_examples.training import ExperimentConfig
from ti_io import DirectorySink, HistoryConfig
from ti_io.report import write_report
from ti_schema import DEFAULT_METRICS, LayerInfo, RunInfo, events_schema, history_schema

playwright = pytest.importorskip("playwright.sync_api", reason="playwright (the test group)")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Debian's chromium is not installed here (apt-get install -y chromium; .ci/run "
    "installs it where it runs as root)",
)
# What a closed network needs: Chromium's own background connections would be refused.
FLAGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)
HOSTILE = "<img src=x onerror=alert(1)>"
TAGGED = "<b>bold</b>"
"""Plotly renders a few tags (b, i, a, br, sub, sup, span) inside its labels."""


class Opened:
    """A report open in Chromium: what the page logged, and its text."""

    def __init__(self, page: Any, errors: list[str], dialogs: list[str], requests: list[str]):
        self.page = page
        self.errors = errors
        self.dialogs = dialogs
        self.requests = requests


@pytest.fixture
def browser() -> Iterator[Any]:
    with playwright.sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=CHROMIUM, args=list(FLAGS))
        try:
            yield launched
        finally:
            launched.close()


def open_report(browser: Any, path: Path) -> Opened:
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors: list[str] = []
    dialogs: list[str] = []
    requests: list[str] = []
    page.on("pageerror", lambda error: errors.append(f"pageerror: {error}"))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(path.resolve().as_uri())
    figures = page.locator("div.plotly-graph-div").count()
    assert figures > 0
    # every figure drawn: Plotly marks each with .js-plotly-plot and a .main-svg
    page.wait_for_function(
        "n => document.querySelectorAll('.js-plotly-plot .main-svg').length >= n",
        arg=figures,
        timeout=30_000,
    )
    return Opened(page, errors, dialogs, requests)


def tick_labels(page: Any) -> list[str]:
    return [
        str(t) for t in page.eval_on_selector_all(".ytick text", "e => e.map(t => t.textContent)")
    ]


def test_an_experiments_report_draws_every_layer_without_errors(
    browser: Any, tmp_path: Path
) -> None:
    problem = PROBLEMS["detached"]
    config = ExperimentConfig(steps=40, sample_every=2)
    result = run_problem(problem, tmp_path / "demo", config)
    opened = open_report(browser, result.report)
    assert opened.errors == []
    assert opened.dialogs == []
    # nothing but the file itself is loaded: the page works offline
    assert {url.split(":", 1)[0] for url in opened.requests} == {"file"}
    text = opened.page.inner_text("body")
    labels = tick_labels(opened.page)
    layers = ["trunk.0", "trunk.1", "trunk.2", "trunk.3", "head"]
    for layer in layers:
        assert layer in text  # the per-layer tables
        assert layer in labels  # the heat maps' rows, drawn by Plotly
    heat_maps = opened.page.locator(".hm image").count()  # one raster per run and panel
    assert heat_maps >= 3
    shot = tmp_path / "report.png"
    opened.page.screenshot(path=str(shot), full_page=False)
    pixels = mpimg.imread(shot)[..., :3]
    colours = np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 200  # heat maps and text, not a blank or one-colour page
    assert float(pixels.std()) > 0.05
    keep = os.environ.get("TI_REPORT_SCREENSHOT")
    if keep:
        shutil.copyfile(shot, keep)


def _hostile_run(directory: Path) -> Path:
    layers = ("fc1", HOSTILE, TAGGED, "fc2")
    run = RunInfo(
        run_id="hostile",
        rank=0,
        world_size=1,
        producer="tests <b>bold</b>",
        started_at=datetime(2026, 1, 1, tzinfo=UTC),
        layers=tuple(LayerInfo(name, "Linear") for name in layers),
        focus_layers=(),
        metrics=DEFAULT_METRICS,
        sampler="<script>alert(3)</script>",
        settings={"note": "<svg onload=alert(4)>"},
    )
    sink = DirectorySink(directory, history_config=HistoryConfig(buffer_rows=64, window=3))
    sink.open(run)
    schema = history_schema("tests")
    for sample in range(6):
        rows = [
            {
                "run_id": "hostile",
                "rank": 0,
                "sample_id": sample,
                "forward_index": sample,
                "timestamp": run.started_at,
                "layer": layer,
                "module_type": "Linear",
                "call_index": 0,
                "signal": "output",
                "tensor_path": "",
                "mode": "train",
                "grad_enabled": True,
                "shape": [4],
                "dtype": "float32",
                "metric": "std",
                "value": 1.0 + sample + i,
                "unavailable_reason": None,
            }
            for i, layer in enumerate(layers)
        ]
        sink.write_history(pa.Table.from_pylist(rows, schema=schema).to_batches()[0])
    event = {name: None for name in events_schema().names}
    event |= {
        "run_id": "hostile",
        "rank": 0,
        "event_id": 0,
        "kind": "nonfinite",
        "forward_index": 3,
        "timestamp": run.started_at,
        "signal": "output",
        "layer": HOSTILE,
        "module_type": "<i>Linear</i>",
        "tensor_path": "",
        "layers": [HOSTILE],
        "tensor_paths": [""],
        "reason": "</script><script>alert(5)</script>",
        "dense_first_forward": 4,
        "dense_forwards": 0,
        "replay": "reproduced",
        "replay_reason": "<a href=javascript:alert(6)>why</a>",
    }
    sink.write_events(pa.Table.from_pylist([event], schema=events_schema("tests")).to_batches()[0])
    sink.close()
    return directory


def test_names_that_are_markup_show_as_text_and_run_nothing(browser: Any, tmp_path: Path) -> None:
    run = _hostile_run(tmp_path / "run")
    report = write_report(run, tmp_path / "report.html")
    opened = open_report(browser, report)
    opened.page.wait_for_timeout(300)  # an onerror or onload would have fired by now
    assert opened.dialogs == []
    assert opened.errors == []
    text = opened.page.inner_text("body")
    for shown in (HOSTILE, "<script>alert(3)</script>", "<svg onload=alert(4)>", "alert(5)"):
        assert shown in text
    labels = tick_labels(opened.page)
    assert HOSTILE in labels  # Plotly's labels: the text, not an element
    assert TAGGED in labels
    # no element came from a run's strings
    assert opened.page.locator("body img").count() == 0
    assert opened.page.locator("body svg [onload], body [onerror]").count() == 0
    assert opened.page.locator("a[href^='javascript']").count() == 0
    assert opened.page.locator("b, i").count() == 0
