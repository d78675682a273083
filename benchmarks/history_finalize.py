"""Finalization cost of a long history: the `history` workload of the benchmarks.

Builds a synthetic run of ``rows`` history rows (50 layers x 2 signals x 9 default metrics per
sample, so 900 rows per sample) through a real ``DirectorySink`` (published as parts by its
writer thread, untimed), then times ``close()``: the last part, streaming every part into
history.parquet and histograms.parquet, result.json from Polars lazy aggregations, index.md
and removing the parts. Peak RSS growth during ``close()`` is sampled by a thread.

    python benchmarks/history_finalize.py [--rows 900000]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import polars  # noqa: F401  (see _load_finalization)
import pyarrow as pa

from ti_io import DirectorySink, HistoryConfig
from ti_schema import DEFAULT_METRICS, LayerInfo, RunInfo, history_schema

LAYERS = 50
SIGNALS = ("output", "output_gradient")
PRODUCER = "ti-io benchmark"


def _load_finalization() -> None:
    """Load what ``close()`` imports before it is timed. A tree whose ``import ti_io`` leaves
    Polars and the finalization modules out (a training process that only writes parts does not
    pay for them) imports them in ``close()``, about 0.3 s and 40 MB once per process; trees
    before it paid that at ``import ti_io``. Loading them first times the finalization alone,
    the same work in either tree."""
    # a reference tree from before ti-io's finish/ subpackage has it loaded already
    with contextlib.suppress(ModuleNotFoundError):
        importlib.import_module("ti_io.finish.consolidate")


def _run_info(layers: list[str]) -> RunInfo:
    return RunInfo(
        run_id="bench",
        rank=0,
        world_size=1,
        producer=PRODUCER,
        started_at=datetime(2026, 1, 1, tzinfo=UTC),
        layers=tuple(LayerInfo(name, "Linear") for name in layers),
        focus_layers=(),
        metrics=DEFAULT_METRICS,
        sampler="AlwaysSampler()",
    )


def sample_batch(
    sample: int,
    layers: list[str],
    rng: np.random.Generator,
    *,
    rank: int = 0,
    missing: float = 0.0,
) -> pa.RecordBatch:
    """One sample's ``ti.history`` rows: every layer's outputs and output gradients, every
    default metric, values from ``rng`` (about ``missing`` of them unavailable); written by
    ``rank``. Also the synthetic runs of tests/test_reading_memory.py and spark_recipe.py."""
    tensors = [(layer, signal) for signal in SIGNALS for layer in layers]
    n = len(tensors) * len(DEFAULT_METRICS)
    unavailable = rng.random(n) < missing if missing else np.zeros(n, bool)
    layer_col = [t[0] for t in tensors for _ in DEFAULT_METRICS]
    signal_col = [t[1] for t in tensors for _ in DEFAULT_METRICS]
    ts = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(milliseconds=sample)
    arrays = {
        "run_id": pa.array([f"bench-{rank}"] * n),
        "rank": pa.array(np.full(n, rank, np.int32)),
        "sample_id": pa.array(np.full(n, sample, np.int64)),
        "forward_index": pa.array(np.full(n, sample, np.int64)),
        "timestamp": pa.array([ts] * n, pa.timestamp("us", tz="UTC")),
        "layer": pa.array(layer_col),
        "module_type": pa.array(["Linear"] * n),
        "call_index": pa.array(np.zeros(n, np.int32)),
        "signal": pa.array(signal_col),
        "tensor_path": pa.array([""] * n),
        "mode": pa.array(["train"] * n),
        "grad_enabled": pa.array(np.ones(n, bool)),
        "shape": pa.array([[32, 128]] * n, pa.list_(pa.int64())),
        "dtype": pa.array(["float32"] * n),
        "metric": pa.array(list(DEFAULT_METRICS) * len(tensors)),
        "value": pa.array(rng.normal(loc=rank, size=n), mask=unavailable),
        "unavailable_reason": pa.array(
            ["no finite entries" if gone else None for gone in unavailable], pa.string()
        ),
    }
    return pa.RecordBatch.from_arrays(list(arrays.values()), schema=history_schema(PRODUCER))


def run(rows: int = 900_000, *, directory: str | None = None) -> dict[str, Any]:
    """Finalize a synthetic ``rows``-row history; returns seconds, peak RSS growth and counts."""
    layers = [f"blocks.{i}.proj" for i in range(LAYERS)]
    per_sample = LAYERS * len(SIGNALS) * len(DEFAULT_METRICS)
    samples = -(-rows // per_sample)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        out = Path(tmp) / "stats"
        sink = DirectorySink(out, history_config=HistoryConfig())
        sink.open(_run_info(layers))
        written = 0
        for sample in range(samples):
            batch = sample_batch(sample, layers, rng)
            if written + batch.num_rows > rows:
                batch = batch.slice(0, rows - written)
            sink.write_history(batch)
            written += batch.num_rows
        _load_finalization()
        import psutil  # the bench group's; sample_batch's users (tests, spark) need none

        process = psutil.Process()
        time.sleep(0.5)  # let the writer publish what it holds, so close() is measured alone
        baseline = process.memory_info().rss
        peak = baseline
        done = threading.Event()

        def sample_rss() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, process.memory_info().rss)
                time.sleep(0.005)

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        cpu = process.cpu_times()
        start = time.perf_counter()
        sink.close()
        seconds = time.perf_counter() - start
        cpu_after = process.cpu_times()
        done.set()
        sampler.join()
        peak = max(peak, process.memory_info().rss)
        history_bytes = (out / "history.parquet").stat().st_size
        result_bytes = (out / "result.json").stat().st_size
    return {
        "workload": "history",
        "rows": written,
        "samples": samples,
        "finalize_s": round(seconds, 3),
        "finalize_cpu_s": round((cpu_after.user - cpu.user) + (cpu_after.system - cpu.system), 3),
        "peak_rss_growth_mb": round((peak - baseline) / 2**20, 1),
        "baseline_rss_mb": round(baseline / 2**20, 1),
        "history_parquet_mb": round(history_bytes / 2**20, 2),
        "result_json_kb": round(result_bytes / 2**10, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=900_000)
    args = parser.parse_args()
    print(json.dumps(run(args.rows), indent=2))


if __name__ == "__main__":
    main()
