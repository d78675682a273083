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
from history_finalize import SIGNALS, sample_batch

from ti_io import DirectorySink, HistoryConfig
from ti_io.read.aggregates import AGGREGATES
from ti_io.read.ordering import GROUP_KEYS
from ti_schema import DEFAULT_METRICS, LayerInfo, RunInfo

DOC = Path(__file__).resolve().parents[1] / "docs" / "reading-at-scale.md"
KEYS = list(GROUP_KEYS)
NUMBERS = ["latest_sample", "latest", "observations", "unavailable", *AGGREGATES]
"""``ti summary --csv``'s numbers, which the query reproduces."""
LAYERS = [f"blocks.{i}" for i in range(20)]


def recipe(name: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    found = re.search(rf"<!-- recipe: {name} -->\n```sql\n(.*?)```", text, re.DOTALL)
    if not found:
        raise SystemExit(f"no <!-- recipe: {name} --> query in {DOC}")
    return found.group(1)


def write_run(root: Path, ranks: int, rows: int) -> None:
    per_sample = len(SIGNALS) * len(LAYERS) * len(DEFAULT_METRICS)
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
            sink.write_history(sample_batch(sample, LAYERS, rng, rank=rank, missing=0.02))
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
