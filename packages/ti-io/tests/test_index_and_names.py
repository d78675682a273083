"""index.md and arbitrary module names: safe in every artifact, queries ready to run."""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl
from _io_helpers import Synth, make_run

from ti_io import DirectorySink, HistoryConfig
from ti_io.index_md import md_escape
from ti_schema import METRIC_DEFINITIONS, SCHEMA_VERSION, validate_result_json
from ti_schema.testing import load_strict_json

NASTY = (
    ("../../escape", "Linear"),
    ("a/b", "ReLU"),
    ("line\n```\n# heading", "Linear"),
    ("<script>alert('x')</script>", "Tanh"),
    ("| col | `tick` *em* [link](http://x)", "Linear"),
    ("", "Model"),
)


def _finished(tmp_path: Path) -> Path:
    out = tmp_path / "stats"
    run = make_run(NASTY, focus=tuple(n for n, _ in NASTY[:3]))
    s = Synth(run, empty_every=2)
    sink = DirectorySink(out, history_config=HistoryConfig(buffer_rows=50, window=2))
    sink.open(run)
    for i in range(6):
        sink.write_history(s.history(i))
        sink.write_histograms(s.histograms(i))
    sink.close()
    return out


def _outside_fences(markdown: str) -> str:
    return re.sub(r"^```[a-z]*\n.*?^```$", "", markdown, flags=re.S | re.M)


def test_arbitrary_names_stay_inside_the_directory_and_the_formats(tmp_path: Path) -> None:
    out = _finished(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats"]
    assert {p.name for p in out.iterdir()} == {
        "history.parquet",
        "histograms.parquet",
        "result.json",
        "index.md",
        "tensorboard",
    }
    records = load_strict_json(out / "result.json")
    validate_result_json(records)
    assert [r["layer"] for r in records] == [n for n, _ in NASTY]
    layers = set(pl.read_parquet(out / "history.parquet").get_column("layer").unique())
    assert layers == {n for n, _ in NASTY}
    index = (out / "index.md").read_text()
    prose = _outside_fences(index)
    for name, _ in NASTY[:5]:
        assert name not in prose
    assert "<script>" not in index  # only as an escaped JSON literal
    assert index.count("```") % 2 == 0
    for line in index.splitlines():  # no name line can open or close a fence
        assert not line.startswith("```") or re.fullmatch(r"```[a-z]*", line)


def test_index_explains_the_run_and_its_queries_run(tmp_path: Path) -> None:
    out = _finished(tmp_path)
    index = (out / "index.md").read_text()
    assert f"version {SCHEMA_VERSION}" in index
    assert "EveryNForwardsSampler(n=1)" in index
    assert "samples:       6 (sample_id 0 .. 5)" in index
    for definition in METRIC_DEFINITIONS.values():
        assert md_escape(definition) in index
    assert "sample_id" in index
    assert "always order by `sample_id`" in index
    code = re.search(r"^```python\n(.*?)^```$", index, flags=re.S | re.M)
    assert code is not None
    namespace: dict[str, object] = {}
    exec(compile(code.group(1), "index.md", "exec"), namespace)
    trend = namespace["trend"]
    assert isinstance(trend, pl.DataFrame)
    assert trend.height == 6  # the example layer is this run's own first focus layer
    assert trend.get_column("sample_id").to_list() == list(range(6))
    record = namespace["record"]
    assert isinstance(record, dict)
    assert record["layer"] == NASTY[0][0]
