"""docs/reading-at-scale.md's Spark recipe, run: pyspark in local mode reads an all-ranks run
written by the project and reproduces ``ti summary --csv`` of every rank.

Writes ``--ranks`` ranks of ``--rows`` history rows each with ti-io's ``DirectorySink``
(synthetic values, some unavailable), reads ``rank-*/history.parquet`` with Spark, runs the
page's query (``<!-- recipe: spark -->``), and compares every number with ``ti summary --csv``
of each rank (relative 1e-12). Prints the rows, Spark's time and the largest difference; exits
1 on a mismatch. ``nox -s spark`` runs it (pyspark from PyPI; Java 17 from Debian:
``apt-get install openjdk-17-jre-headless``).

    python benchmarks/spark_recipe.py [--ranks 8] [--rows 200000]
"""

from __future__ import annotations

import argparse
import io
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

from ti_io import DirectorySink, HistoryConfig
from ti_schema import DEFAULT_METRICS, LayerInfo, RunInfo, history_schema

DOC = Path(__file__).resolve().parents[1] / "docs" / "reading-at-scale.md"
KEYS = ["layer", "call_index", "signal", "tensor_path", "mode", "grad_enabled", "metric"]
NUMBERS = [
    "latest_sample",
    "latest",
    "observations",
    "unavailable",
    "mean",
    "std",
    "min",
    "p25",
    "p50",
    "p75",
    "max",
    "recent_window_mean",
    "previous_window_mean",
]
LAYERS = [f"blocks.{i}" for i in range(20)]


def recipe(name: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    found = re.search(rf"<!-- recipe: {name} -->\n```sql\n(.*?)```", text, re.DOTALL)
    if not found:
        raise SystemExit(f"no <!-- recipe: {name} --> query in {DOC}")
    return found.group(1)


def _batch(rank: int, sample: int, rng: np.random.Generator) -> pa.RecordBatch:
    keys = [(layer, signal) for signal in ("output", "output_gradient") for layer in LAYERS]
    n = len(keys) * len(DEFAULT_METRICS)
    value = rng.normal(loc=rank, size=n)
    missing = rng.random(n) < 0.02
    columns = {
        "run_id": pa.array([f"run-{rank}"] * n),
        "rank": pa.array(np.full(n, rank, np.int32)),
        "sample_id": pa.array(np.full(n, sample, np.int64)),
        "forward_index": pa.array(np.full(n, sample, np.int64)),
        "timestamp": pa.array([datetime(2026, 1, 1, tzinfo=UTC)] * n, pa.timestamp("us", "UTC")),
        "layer": pa.array([layer for layer, _ in keys for _ in DEFAULT_METRICS]),
        "module_type": pa.array(["Linear"] * n),
        "call_index": pa.array(np.zeros(n, np.int32)),
        "signal": pa.array([signal for _, signal in keys for _ in DEFAULT_METRICS]),
        "tensor_path": pa.array([""] * n),
        "mode": pa.array(["train"] * n),
        "grad_enabled": pa.array(np.ones(n, bool)),
        "shape": pa.array([[32, 64]] * n, pa.list_(pa.int64())),
        "dtype": pa.array(["float32"] * n),
        "metric": pa.array(list(DEFAULT_METRICS) * len(keys)),
        "value": pa.array(value, mask=missing),
        "unavailable_reason": pa.array(["no finite entries" if m else None for m in missing]),
    }
    return pa.RecordBatch.from_arrays(list(columns.values()), schema=history_schema("spark"))


def write_run(root: Path, ranks: int, rows: int) -> None:
    per_sample = 2 * len(LAYERS) * len(DEFAULT_METRICS)
    for rank in range(ranks):
        info = RunInfo(
            run_id=f"run-{rank}",
            rank=rank,
            world_size=ranks,
            producer="spark recipe",
            started_at=datetime(2026, 1, 1, tzinfo=UTC),
            layers=tuple(LayerInfo(name, "Linear") for name in LAYERS),
            focus_layers=(),
            metrics=DEFAULT_METRICS,
            sampler="AlwaysSampler()",
            settings={"rank_policy": "'all'"},
        )
        sink = DirectorySink(root / f"rank-{rank:03d}", history_config=HistoryConfig(window=20))
        sink.open(info)
        rng = np.random.default_rng(rank)
        for sample in range(max(rows // per_sample, 45)):
            sink.write_history(_batch(rank, sample, rng))
        sink.close()


def ti_summary(run: Path) -> pl.DataFrame:
    code = "import sys; from ti_io.cli import main; sys.exit(main())"
    done = subprocess.run(
        [sys.executable, "-c", code, "summary", str(run), "--csv"],
        capture_output=True,
        text=True,
        check=True,
    )
    table = pl.read_csv(io.StringIO(done.stdout), infer_schema_length=None)
    return table.filter(pl.col("executed")).select(*KEYS, *NUMBERS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rows", type=int, default=200_000, help="history rows per rank")
    args = parser.parse_args()
    java = shutil.which("java")
    if java is None:
        raise SystemExit(
            "spark_recipe.py: Spark needs Java 17; on Debian: apt-get install -y "
            "openjdk-17-jre-headless"
        )
    from pyspark.sql import SparkSession

    work = Path(tempfile.mkdtemp(prefix="ti-spark-"))
    try:
        write_run(work / "run", args.ranks, args.rows)
        spark = (
            SparkSession.builder.master("local[*]")
            .appName("ti-reading-recipe")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.session.timeZone", "UTC")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        start = time.perf_counter()
        history = spark.read.parquet(str(work / "run" / "rank-*" / "history.parquet"))
        history.createOrReplaceTempView("history")
        rows = history.count()
        result = pl.from_pandas(spark.sql(recipe("spark")).toPandas())
        seconds = time.perf_counter() - start
        spark.stop()
        worst = 0.0
        compared = 0
        for rank in range(args.ranks):
            ours = ti_summary(work / "run" / f"rank-{rank:03d}")
            theirs = result.filter(pl.col("rank") == rank).select(*KEYS, *NUMBERS)
            joined = ours.join(theirs, on=KEYS, how="full", suffix="_spark", nulls_equal=True)
            if not joined.height == ours.height == theirs.height:
                raise SystemExit(f"rank {rank}: {ours.height} measurements vs {theirs.height}")
            for name in NUMBERS:
                pairs = zip(joined[name].to_list(), joined[f"{name}_spark"].to_list(), strict=True)
                for a, b in pairs:
                    if (a is None) != (b is None):
                        raise SystemExit(f"rank {rank} {name}: ti {a!r}, Spark {b!r}")
                    if a is not None:
                        difference = abs(float(a) - float(b)) / max(abs(float(a)), 1e-300)
                        worst = max(worst, difference if math.isfinite(difference) else 0.0)
                        compared += 1
        print(
            f"spark_recipe.py: pyspark {spark.version} local mode read {rows} rows of "
            f"{args.ranks} ranks and ran the summary query in {seconds:.1f} s; {compared} "
            f"numbers equal ti summary's (largest relative difference {worst:.1e})"
        )
        if worst > 1e-12:
            raise SystemExit(1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
