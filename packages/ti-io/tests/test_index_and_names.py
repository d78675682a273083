"""index.md and arbitrary module names: safe in every artifact, queries ready to run."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from _io_helpers import PRODUCER, START, Synth, make_run

from ti_io import DirectorySink, HistoryConfig
from ti_io.finish.markdown import md_escape
from ti_schema import (
    DEFAULT_METRICS,
    METRIC_DEFINITIONS,
    SCHEMA_VERSION,
    SIGNAL_DEFINITIONS,
    history_schema,
    validate_result_json,
)
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
        "events.parquet",
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


def _profile(values: np.ndarray) -> dict[str, float]:
    finite = values[np.isfinite(values)]
    return {
        "mean": float(finite.mean()),
        "std": float(finite.std()),
        "min": float(finite.min()),
        "max": float(finite.max()),
        "p25": float(np.percentile(finite, 25)),
        "p50": float(np.percentile(finite, 50)),
        "p75": float(np.percentile(finite, 75)),
        "zero_fraction": float(np.mean(values == 0)),
        "nonfinite_fraction": float(np.mean(~np.isfinite(values))),
    }


def test_index_queries_give_weight_norms_and_update_to_weight_ratios(tmp_path: Path) -> None:
    """The weight norm and the update-to-weight ratio queries of index.md, run on a history of
    known tensors, equal numpy's norms of those tensors (the bias holds a NaN: its norm is
    over the finite entries)."""
    rng = np.random.default_rng(5)
    run = make_run((("fc", "Linear"), ("act", "ReLU")))
    tensors: dict[tuple[int, str, str], np.ndarray] = {}
    for sample in range(3):
        weight = rng.normal(0.1, 0.5, size=(4, 6))
        bias = rng.normal(size=5)
        bias[2] = np.nan
        tensors[(sample, "parameter", "weight")] = weight
        tensors[(sample, "parameter", "bias")] = bias
        tensors[(sample, "parameter_update", "weight")] = rng.normal(0, 1e-3, size=(4, 6))
        tensors[(sample, "parameter_update", "bias")] = rng.normal(0, 1e-2, size=5)
    rows: dict[str, list[object]] = {n: [] for n in history_schema().names}
    for (sample, signal, path), values in tensors.items():
        for metric, value in _profile(values).items():
            row = {
                "run_id": run.run_id,
                "rank": 0,
                "sample_id": sample,
                "forward_index": 3 * sample,
                "timestamp": START,
                "layer": "fc",
                "module_type": "Linear",
                "call_index": 0,
                "signal": signal,
                "tensor_path": path,
                "mode": "train",
                "grad_enabled": True,
                "shape": list(values.shape),
                "dtype": "float64" if signal == "parameter_update" else "float32",
                "metric": metric,
                "value": value,
                "unavailable_reason": None,
            }
            for key, item in row.items():
                rows[key].append(item)
    out = tmp_path / "stats"
    sink = DirectorySink(out)
    sink.open(run)
    sink.write_history(pa.table(rows, schema=history_schema(PRODUCER)).to_batches()[0])
    sink.close()
    index = (out / "index.md").read_text()
    for signal, text in SIGNAL_DEFINITIONS.items():
        assert f"| {md_escape(signal)} | {md_escape(text)} |" in index
    assert "||x||_2 = sqrt(n * (std**2 + mean**2))" in index
    code = re.search(r"^```python\n(.*?)^```$", index, flags=re.S | re.M)
    assert code is not None
    namespace: dict[str, object] = {}
    exec(compile(code.group(1), "index.md", "exec"), namespace)
    norms = namespace["weight_norm"]
    ratios = namespace["update_to_weight"]
    assert isinstance(norms, pl.DataFrame)
    assert isinstance(ratios, pl.DataFrame)
    assert norms.height == ratios.height == 6

    def norm(values: np.ndarray) -> float:
        return float(np.linalg.norm(values[np.isfinite(values)]))

    for layer, path, sample, value in norms.iter_rows():
        assert layer == "fc"
        assert value == pytest.approx(norm(tensors[(sample, "parameter", path)]), rel=1e-12)
    for _, path, sample, ratio in ratios.iter_rows():
        expected = norm(tensors[(sample, "parameter_update", path)]) / norm(
            tensors[(sample, "parameter", path)]
        )
        assert ratio == pytest.approx(expected, rel=1e-12)
    assert set(DEFAULT_METRICS) <= set(pl.read_parquet(out / "history.parquet")["metric"])
