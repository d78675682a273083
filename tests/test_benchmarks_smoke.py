"""Smoke test of the benchmark harness itself: it runs end to end and writes the CSV it promises.

No timing is asserted (costs belong to ``nox -s bench``); only that each configuration ran in its
own worker, produced a measurement, and that the observed ones recorded history rows.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "run.py"

pytest.importorskip("psutil")
pytest.importorskip("ti_io")


def test_quick_sequence_run_writes_expected_csv(tmp_path: Path) -> None:
    output = tmp_path / "bench.csv"
    done = subprocess.run(
        [
            sys.executable,
            str(RUN),
            "--quick",
            "--workloads",
            "sequence",
            "--configs",
            "bare,unsampled,every-memory",
            "--repeats",
            "2",
            "--steps",
            "2",
            "--every-steps",
            "1",
            "--warmup",
            "1",
            "--no-baseline",
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    with output.open(newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
        columns = reader.fieldnames or []
    for column in (
        "workload",
        "impl",
        "config",
        "sink",
        "step_ms_median",
        "ratio",
        "removal_s",
        "peak_rss_mb",
        "history_rows",
        "targets",
        "status",
        "error",
    ):
        assert column in columns
    by_config = {(r["config"], r["sink"]): r for r in rows}
    assert set(by_config) == {("bare", "-"), ("unsampled", "dir"), ("every", "memory")}
    for row in rows:
        assert row["workload"] == "sequence"
        assert row["error"] == ""
        assert float(row["step_ms_median"]) > 0
        assert float(row["peak_rss_mb"]) > 0
    for key in (("unsampled", "dir"), ("every", "memory")):
        observed = by_config[key]
        assert observed["impl"] == "ti"
        assert float(observed["ratio"]) > 0
        assert float(observed["removal_s"]) >= 0
    # Targets are checked on the directory sink (the real artifact path), not on MemorySink.
    assert by_config[("unsampled", "dir")]["status"] in {"PASS", "FAIL"}
    assert "unsampled <= 1.02x" in by_config[("unsampled", "dir")]["targets"]
    assert by_config[("every", "memory")]["status"] == ""
    # Every forward is sampled: 4 layers x 2 signals x 9 metrics per step (warmup included).
    every = by_config[("every", "memory")]
    assert int(every["history_rows"]) == (1 + 2) * 4 * 2 * 9
    # unsampled: only the first forward (in the warmup) is sampled.
    assert int(by_config[("unsampled", "dir")]["history_rows"]) == 4 * 2 * 9
    assert "Targets (issue 7)" in done.stdout
