"""ti-io end to end: real PyTorch training through inject_observer(output_dir=...)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from ti_core import (
    AlwaysSampler,
    EveryNForwardsSampler,
    has_observer,
    inject_observer,
    remove_observer,
)
from ti_io import (
    DirectorySink,
    HistoryConfig,
    TensorBoardSink,
    consolidate,
    histogram_tag,
    scan_history,
)
from ti_io.cli import main as cli_main
from ti_schema import DEFAULT_METRICS, validate_history
from ti_schema.testing import assert_artifact_dir_conforms, load_strict_json

METRICS = len(DEFAULT_METRICS)


def mlp(width: int = 16, depth: int = 3) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(6, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 2))
    return nn.Sequential(*layers)


def train(model: nn.Module, steps: int, *, seed: int = 0) -> None:
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        x = torch.randn(8, 6)
        loss = (model(x) - x[:, :2]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def leaf_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if not list(m.children())]


def test_training_run_writes_every_artifact_with_exact_rows(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = mlp()
    out = tmp_path / "stats"
    inject_observer(model, output_dir=out, sampler=EveryNForwardsSampler(2))
    try:
        train(model, steps=12)
    finally:
        remove_observer(model)
    leaves = leaf_names(model)  # 7 leaf modules, all executed
    samples = 6
    history = pq.read_table(out / "history.parquet")
    validate_history(history)
    assert history.num_rows == samples * len(leaves) * 2 * METRICS
    histograms = pq.read_table(out / "histograms.parquet")
    assert histograms.num_rows == samples * len(leaves) * 2  # 7 layers <= 8 focus layers
    assert_artifact_dir_conforms(out)
    records = load_strict_json(out / "result.json")
    assert [r["layer"] for r in records] == leaves
    assert {t["signal"] for r in records for t in r["tensors"]} == {"output", "output_gradient"}
    assert cli_main(["validate", str(out)]) == 0


def _numpy_reference(values: list[float | None], window: int) -> dict[str, Any]:
    seen = np.array([v for v in values if v is not None], dtype=np.float64)
    return {
        "observations": len(seen),
        "unavailable": len(values) - len(seen),
        "mean": seen.mean(),
        "std": seen.std(ddof=0),
        "min": seen.min(),
        "p25": np.percentile(seen, 25),
        "p50": np.percentile(seen, 50),
        "p75": np.percentile(seen, 75),
        "max": seen.max(),
        "recent_window_mean": seen[-window:].mean(),
        "previous_window_mean": seen[-2 * window : -window].mean(),
    }


def test_result_json_equals_numpy_reference_from_history(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = mlp(depth=2)
    window = 3
    sink = DirectorySink(tmp_path, history_config=HistoryConfig(buffer_rows=100, window=window))
    inject_observer(model, sink=sink, sampler=AlwaysSampler())
    try:
        train(model, steps=9, seed=1)
    finally:
        remove_observer(model)
    history = pl.read_parquet(tmp_path / "history.parquet").sort("sample_id")
    compared = 0
    for record in load_strict_json(tmp_path / "result.json"):
        for tensor in record["tensors"]:
            for metric, stats in tensor["statistics"].items():
                values = (
                    history.filter(
                        (pl.col("layer") == record["layer"])
                        & (pl.col("call_index") == tensor["call_index"])
                        & (pl.col("signal") == tensor["signal"])
                        & (pl.col("tensor_path") == tensor["tensor_path"])
                        & (pl.col("metric") == metric)
                    )
                    .get_column("value")
                    .to_list()
                )
                if any(v is None for v in values):
                    continue
                for key, expected in _numpy_reference(values, window).items():
                    assert stats[key] == pytest.approx(float(expected), rel=1e-12, abs=1e-15), (
                        record["layer"],
                        tensor["signal"],
                        metric,
                        key,
                    )
                compared += 1
    assert compared >= len(leaf_names(model)) * 2 * METRICS - METRICS


def test_catalog_and_parts_are_readable_while_training(tmp_path: Path) -> None:
    torch.manual_seed(2)
    model = mlp()
    sink = DirectorySink(tmp_path, history_config=HistoryConfig(buffer_rows=64))
    inject_observer(model, sink=sink, sampler=AlwaysSampler())
    try:
        catalog = load_strict_json(tmp_path / "result.json")
        assert [r["layer"] for r in catalog] == leaf_names(model)
        assert all(r["tensors"] == [] for r in catalog)
        assert (tmp_path / "index.md").is_file()
        train(model, steps=5)
        sink.flush()
        parts = sorted((tmp_path / "history.parts").glob("part-*.parquet"))
        assert len(parts) >= 2
        live = scan_history(tmp_path).collect()
        assert live.height == 5 * len(leaf_names(model)) * 2 * METRICS
        train(model, steps=1)
    finally:
        remove_observer(model)
    assert scan_history(tmp_path).select(pl.len()).collect().item() == (
        6 * len(leaf_names(model)) * 2 * METRICS
    )


def _events(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"histograms": 0})
    acc.Reload()
    return acc


def test_focus_layers_in_tensorboard(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = mlp(depth=6)  # 15 leaf modules
    leaves = leaf_names(model)
    inject_observer(model, output_dir=tmp_path / "default", sampler=AlwaysSampler())
    try:
        train(model, steps=2)
    finally:
        remove_observer(model)
    acc = EventAccumulator(
        str(tmp_path / "default" / "tensorboard"), size_guidance={"histograms": 0}
    )
    acc.Reload()
    expected = {
        histogram_tag(n, 0, s, "") for n in leaves[:8] for s in ("output", "output_gradient")
    }
    assert set(acc.Tags()["histograms"]) == expected
    assert [e.step for e in acc.Histograms(histogram_tag(leaves[0], 0, "output", ""))] == [0, 1]

    chosen = [leaves[3], leaves[-1]]
    inject_observer(
        model, output_dir=tmp_path / "chosen", sampler=AlwaysSampler(), histogram_selector=chosen
    )
    try:
        train(model, steps=1)
    finally:
        remove_observer(model)
    acc = EventAccumulator(
        str(tmp_path / "chosen" / "tensorboard"), size_guidance={"histograms": 0}
    )
    acc.Reload()
    assert set(acc.Tags()["histograms"]) == {
        histogram_tag(n, 0, s, "") for n in chosen for s in ("output", "output_gradient")
    }


def test_caller_owned_summary_writer_survives_removal(tmp_path: Path) -> None:
    torch.manual_seed(4)
    model = mlp(depth=2)
    writer = SummaryWriter(str(tmp_path / "tb"))
    inject_observer(
        model, output_dir=tmp_path / "stats", sink=TensorBoardSink(writer), sampler=AlwaysSampler()
    )
    try:
        train(model, steps=3)
    finally:
        remove_observer(model)
    writer.add_scalar("loss", 0.25, global_step=3)  # the caller's writer still works
    writer.flush()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(3, 0.25)]
    assert len(acc.Tags()["histograms"]) == len(leaf_names(model)) * 2
    assert (tmp_path / "stats" / "history.parquet").is_file()  # directory artifacts as well
    writer.close()


def test_existing_run_is_not_overwritten(tmp_path: Path) -> None:
    torch.manual_seed(5)
    model = mlp(depth=2)
    inject_observer(model, output_dir=tmp_path, sampler=AlwaysSampler())
    train(model, steps=2)
    remove_observer(model)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(FileExistsError, match="overwrite=True"):
        inject_observer(model, output_dir=tmp_path)
    assert not has_observer(model)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


KILLED_RUN = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from ti_core import AlwaysSampler, inject_observer
    from ti_io import DirectorySink, HistoryConfig

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 3)
    )
    sink = DirectorySink(sys.argv[1], history_config=HistoryConfig(buffer_rows=200))
    inject_observer(model, sink=sink, sampler=AlwaysSampler())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    while True:  # killed from outside
        x = torch.randn(4, 1, 8, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    """
)


@pytest.mark.slow
def test_sigkill_leaves_complete_parts_and_consolidate_recovers_them(tmp_path: Path) -> None:
    out = tmp_path / "stats"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(out)])
    try:
        deadline = time.monotonic() + 120
        while len(list((out / "history.parts").glob("part-*.parquet"))) < 2:
            assert proc.poll() is None, "training process died on its own"
            assert time.monotonic() < deadline, "no parts were published"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "history.parquet").exists()
    parts = sorted((out / "history.parts").glob("*.parquet"))
    assert all(p.name.startswith("part-") for p in parts)  # temporaries never end in .parquet
    held = 0
    for part in parts:
        table = pq.read_table(part)  # every published part is complete
        validate_history(table)
        held += table.num_rows
    assert held >= 400
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"histograms": 0})
    acc.Reload()  # the events flushed before the kill are readable
    assert acc.Tags()["histograms"]
    assert min(len(acc.Histograms(t)) for t in acc.Tags()["histograms"]) >= 1

    ti = shutil.which("ti") or ""
    command = [ti] if ti else [sys.executable, "-m", "ti_io.cli"]
    done = subprocess.run([*command, "consolidate", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    history = pq.read_table(out / "history.parquet")
    assert history.num_rows == held  # every row the parts held
    assert not (out / "history.parts").exists()
    assert_artifact_dir_conforms(out)
    records = load_strict_json(out / "result.json")
    assert [r["layer"] for r in records] == ["0", "1", "2", "3"]  # catalog written at attach
    assert consolidate(out).already_done  # idempotent
    info = json.loads(history.schema.metadata[b"ti"])
    assert info["producer"].startswith("ti-core")


def test_exit_without_removal_keeps_every_row_for_consolidate(tmp_path: Path) -> None:
    from ti_io.write.directory_sink import _flush_live_sinks

    torch.manual_seed(6)
    model = mlp(depth=2)
    sink = DirectorySink(tmp_path, history_config=HistoryConfig(buffer_rows=1000))
    inject_observer(model, sink=sink, sampler=AlwaysSampler())
    try:
        train(model, steps=3)
        _flush_live_sinks()  # what the interpreter-exit hook does when removal never comes
        assert not (tmp_path / "history.parquet").exists()
        done = consolidate(tmp_path)
        assert done.history_rows == 3 * len(leaf_names(model)) * 2 * METRICS
    finally:
        remove_observer(model)  # the sink is already closed: removal only restores hooks
    assert not has_observer(model)


def test_history_benchmark_runs_at_small_scale() -> None:
    import importlib.util

    path = Path(__file__).parents[1] / "benchmarks" / "history_finalize.py"
    spec = importlib.util.spec_from_file_location("history_finalize", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.run(rows=9_000)
    assert result["rows"] == 9_000
    assert result["samples"] == 10
    assert result["finalize_s"] > 0
    assert result["peak_rss_growth_mb"] >= 0


LIVE_PATIENCE_S = 30.0
"""A deadlock guard for the live-rows test, far above the designed latency (flush_seconds plus
one part's write) so a loaded machine cannot fail it; the latency itself is asserted below."""


def _live_rows(run: Path) -> pl.DataFrame | None:
    if not list((run / "history.parts").glob("part-*.parquet")):
        return None
    return pl.scan_parquet(run / "history.parts" / "*.parquet").collect()


@pytest.mark.parametrize(
    "sampler", [None, AlwaysSampler()], ids=["default TimedSampler", "AlwaysSampler"]
)
def test_every_sample_is_readable_live_seconds_after_its_signal_ends(
    tmp_path: Path, sampler: AlwaysSampler | None
) -> None:
    """Default settings, four forward+backward steps (0.8.0 published a part after each), then
    no further step: the writer's own clock publishes the rows,
    which Polars reads from history.parts/ and `ti summary` shows while the model is still
    attached."""
    run = tmp_path / "stats"
    model = nn.Sequential(nn.Linear(4, 4), nn.Identity())
    extra = {} if sampler is None else {"sampler": sampler}
    inject_observer(model, output_dir=run, **extra)
    try:
        for _ in range(4):
            model(torch.randn(2, 4)).sum().backward()
        ended = time.monotonic()
        expected = {0, 1, 2, 3} if sampler is not None else {0}  # TimedSampler: the first
        seen: pl.DataFrame | None = None
        while True:
            seen = _live_rows(run)
            if seen is not None:
                got = {
                    (f, s) for f, s in seen.select("forward_index", "signal").unique().iter_rows()
                }
                if got >= {(f, s) for f in expected for s in ("output", "output_gradient")}:
                    break
            assert time.monotonic() - ended < LIVE_PATIENCE_S, "rows never became readable"
            time.sleep(0.02)
        latency = time.monotonic() - ended
        # Designed bound: flush_seconds (1 s) after the oldest row, plus one part's write.
        assert latency < 2.0 + 1.0, latency  # one second of slack for a loaded machine
        assert set(seen.get_column("forward_index").unique()) == expected
        summary = subprocess.run(
            [str(Path(sys.executable).with_name("ti")), "summary", str(run), "--csv"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert summary.returncode == 0, summary.stderr
        table = pl.read_csv(summary.stdout.encode())
        counts = table.filter(pl.col("metric") == "mean").select("layer", "signal", "observations")
        assert sorted(counts.iter_rows()) == [
            (layer, signal, len(expected))
            for layer in (0, 1)
            for signal in ("output", "output_gradient")
        ]
    finally:
        remove_observer(model)


def test_index_md_names_a_0_8_0_reducer_that_failed_and_why(tmp_path: Path) -> None:
    def needs_real_tensors(tensor: torch.Tensor) -> dict[str, float]:
        raise RuntimeError("needs the model's own tensors")

    run = tmp_path / "stats"
    model = mlp()
    with pytest.warns(FutureWarning):
        inject_observer(
            model,
            output_dir=run,
            sampler=AlwaysSampler(),
            reducers=[needs_real_tensors],
            error_policy="ignore",
        )
    train(model, 2)
    remove_observer(model)
    index = (run / "index.md").read_text(encoding="utf-8")
    assert "needs_real_tensors raised on every probe tensor" in index  # the attach-time note
    assert '"needs_real_tensors" / "RuntimeError: needs the model\'s own tensors"' in index
    table = pl.read_parquet(run / "history.parquet")
    assert table.get_column("value").null_count() == table.height
