"""Smoke test of the benchmark harness itself: it runs end to end and writes the CSV it promises.

No timing is asserted (costs belong to ``nox -s bench``); only that each configuration ran in its
own worker, produced a measurement, and that the observed ones recorded history rows. How rounds
combine into ratios is checked on given per-round results against numpy, without timing anything.
"""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from ti_schema import DEFAULT_METRICS

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "run.py"

ROUND_COLUMNS = (
    "rounds",
    "ratio_min",
    "ratio_max",
    "round_ratios",
    "round_ratios_of_min",
    "round_step_ms_median",
    "round_removal_s",
    "round_history_rows",
    "note",
)


def _quick_sequence_run(
    tmp_path: Path, configs: str, *extra: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """run.py on a tiny sequence plan (one round, two blocks, one warmup step), no baseline;
    the finished process and the CSV it wrote."""
    output = tmp_path / "bench.csv"
    done = subprocess.run(
        [
            sys.executable,
            str(RUN),
            "--quick",
            "--workloads",
            "sequence",
            "--configs",
            configs,
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
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    return done, output


def test_quick_sequence_run_writes_expected_csv(tmp_path: Path) -> None:
    done, output = _quick_sequence_run(tmp_path, "bare,unsampled,every-memory")
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
        *ROUND_COLUMNS,
    ):
        assert column in columns
    by_config = {(r["config"], r["sink"]): r for r in rows}
    assert set(by_config) == {("bare", "-"), ("unsampled", "dir"), ("every", "memory")}
    for row in rows:
        assert row["workload"] == "sequence"
        assert row["error"] == ""
        assert float(row["step_ms_median"]) > 0
        assert float(row["peak_rss_mb"]) > 0
        assert row["rounds"] == "1"  # --quick: one round
        assert float(row["round_step_ms_median"]) == pytest.approx(float(row["step_ms_median"]))
    for key in (("unsampled", "dir"), ("every", "memory")):
        observed = by_config[key]
        assert observed["impl"] == "ti"
        assert float(observed["ratio"]) > 0
        assert float(observed["ratio_of_min"]) > 0
        # One round: the ratio is that round's, and the spread is that one value.
        assert float(observed["round_ratios"]) == pytest.approx(float(observed["ratio"]), abs=1e-4)
        assert float(observed["ratio_min"]) == float(observed["ratio_max"])
        assert observed["note"] == ""
        assert float(observed["removal_s"]) >= 0
    # Targets are checked on the directory sink (the real artifact path); the every-forward
    # ones also on MemorySink, as their own line.
    assert by_config[("unsampled", "dir")]["status"] in {"PASS", "FAIL"}
    assert "unsampled <= 1.02x" in by_config[("unsampled", "dir")]["targets"]
    assert by_config[("every", "memory")]["status"] in {"PASS", "FAIL"}
    assert by_config[("every", "memory")]["targets"] == "every forward, MemorySink <= 3x"
    # Every forward is sampled: 4 layers x 2 signals x the metrics per step (warmup included).
    every = by_config[("every", "memory")]
    assert int(every["history_rows"]) == (1 + 2) * 4 * 2 * len(DEFAULT_METRICS)
    # unsampled: only the first forward (in the warmup) is sampled.
    assert int(by_config[("unsampled", "dir")]["history_rows"]) == 4 * 2 * len(DEFAULT_METRICS)
    assert "Targets (why each limit: benchmarks/README.md)" in done.stdout
    assert "1 round(s) per workload" in done.stdout
    # each ratio target names the bare step it was measured against
    bare_ms = float(by_config[("bare", "-")]["step_ms_median"])
    assert f"[bare {bare_ms:.3g} ms, fast end ~1.3 ms]" in done.stdout


@pytest.fixture(scope="module")
def harness() -> Iterator[ModuleType]:
    """benchmarks/run.py as a module (it puts benchmarks/ on sys.path; restored afterwards)."""
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location("bench_run", RUN)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        sys.path[:] = saved


def _got(median: float, mean: float, low: float, **extra: Any) -> dict[str, Any]:
    """A worker result as worker.py reports it (seconds per step)."""
    return {"step_s_median": median, "step_s_mean": mean, "step_s_min": low, **extra}


def test_round_order_alternates_forward_and_reversed(harness: ModuleType) -> None:
    items = ["bare", "unsampled", "every"]
    assert harness.round_order(items, 0) == items
    assert harness.round_order(items, 1) == items[::-1]
    assert harness.round_order(items, 2) == items


def test_ratio_is_median_of_same_round_ratios(harness: ModuleType) -> None:
    # Drift: bare is slow in round 2; a ratio of the medians over rounds would mix rounds.
    bare_median = np.array([2.0e-3, 3.0e-3, 2.5e-3])
    bare_min = np.array([1.8e-3, 2.9e-3, 2.4e-3])
    cfg_median = np.array([2.2e-3, 3.3e-3, 2.4e-3])
    cfg_min = np.array([2.1e-3, 3.0e-3, 2.3e-3])
    bare = [_got(m, m, lo) for m, lo in zip(bare_median, bare_min, strict=True)]
    rounds = [
        _got(m, m, lo, removal_s=r, peak_rss_mb=p, history_rows=72)
        for m, lo, r, p in zip(cfg_median, cfg_min, (0.1, 0.3, 0.2), (380, 390, 385), strict=True)
    ]
    spec = {
        "workload": "sequence",
        "config": "unsampled",
        "label": "unsampled",
        "impl": "ti",
        "sink": "dir",
    }
    row = harness.aggregate("run", spec, rounds, bare)

    per_round = cfg_median / bare_median
    assert row["ratio"] == pytest.approx(float(np.median(per_round)), abs=1e-4)
    assert row["ratio"] != pytest.approx(float(np.median(cfg_median) / np.median(bare_median)))
    assert row["ratio_min"] == pytest.approx(float(per_round.min()), abs=1e-4)
    assert row["ratio_max"] == pytest.approx(float(per_round.max()), abs=1e-4)
    assert row["ratio_of_min"] == pytest.approx(float(np.median(cfg_min / bare_min)), abs=1e-4)
    assert [float(r) for r in row["round_ratios"].split(";")] == pytest.approx(per_round, abs=1e-4)
    assert row["ratio_basis"] == "median"
    assert row["step_ms_median"] == pytest.approx(float(np.median(cfg_median)) * 1e3, abs=1e-4)
    assert row["step_ms_min"] == pytest.approx(float(cfg_min.min()) * 1e3, abs=1e-4)
    assert row["removal_s"] == pytest.approx(0.2)
    assert row["peak_rss_mb"] == pytest.approx(385)
    assert row["history_rows"] == 72
    assert row["rounds"] == 3
    assert row["round_history_rows"] == "72;72;72"
    assert row["error"] == ""
    assert "note" not in row


def test_failed_round_and_differing_rows_are_reported(harness: ModuleType) -> None:
    bare = [_got(2e-3, 2e-3, 2e-3), _got(2e-3, 2e-3, 2e-3), _got(4e-3, 4e-3, 4e-3)]
    rounds = [
        _got(2e-3, 3e-3, 2e-3, history_rows=10),
        {"error": "RuntimeError: boom"},
        _got(4e-3, 5e-3, 4e-3, history_rows=11),
    ]
    spec = {
        "workload": "sequence",
        "config": "every",
        "label": "every",
        "impl": "ti",
        "sink": "dir",
    }
    row = harness.aggregate("run", spec, rounds, bare)
    assert row["error"] == "round 2: RuntimeError: boom"
    assert row["rounds"] == 2
    assert row["round_ratios"] == "1.0000;;1.0000"
    assert row["ratio"] == pytest.approx(1.0)
    assert "history rows differ across rounds: 10;;11" in row["note"]
    # The interval's ratio is of means (its amortized cost) and its rows follow the clock.
    interval = harness.aggregate(
        "run", {**spec, "config": "interval", "label": "interval"}, rounds, bare
    )
    assert interval["ratio_basis"] == "mean"
    assert interval["round_ratios"] == "1.5000;;1.2500"
    assert interval["ratio"] == pytest.approx(float(np.median([1.5, 1.25])))
    assert "note" not in interval


def test_targets_preset_selects_the_sampled_step_workloads(harness: ModuleType) -> None:
    args = harness.parse_args(["--targets", "--no-baseline"])
    assert args.workloads == ["sequence", "many", "large"]
    assert args.configs == ["bare", "every", "every-memory", "interval"]
    assert args.rounds == 5
    narrowed = harness.parse_args(["--targets", "--workloads", "many", "--rounds", "2"])
    assert (narrowed.workloads, narrowed.rounds) == (["many"], 2)


def test_bare_speed_gives_the_median_and_range_over_rounds(harness: ModuleType) -> None:
    bare = {
        "workload": "sequence",
        "device": "cpu",
        "config": "bare",
        "step_ms_median": 1.52,
        "round_step_ms_median": "1.4100;1.5200;2.0300",
    }
    assert harness.bare_speed([bare], "sequence", "cpu") == (
        "bare 1.52 ms (1.41-2.03), fast end ~1.3 ms"
    )
    assert harness.bare_speed([{**bare, "workload": "many"}], "many", "cpu") == (
        "bare 1.52 ms (1.41-2.03)"
    )
    assert harness.bare_speed([bare], "large", "cpu") == ""


def test_against_reference_divides_same_round_ratios(harness: ModuleType) -> None:
    # Per round, this tree's ratio over the reference's (both against that round's bare step).
    ti = np.array([2.0, 2.4, 3.1])
    ref = np.array([2.5, 2.0, 3.1])
    row = {"config": "every", "round_ratios": ";".join(f"{r:.4f}" for r in ti)}
    got = harness.against_reference(
        row, {"config": "every", "round_ratios": ";".join(f"{r:.4f}" for r in ref)}
    )
    per_round = ti / ref
    assert got["median"] == pytest.approx(float(np.median(per_round)))
    assert got["min"] == pytest.approx(float(per_round.min()))
    assert got["max"] == pytest.approx(float(per_round.max()))
    # A round that one side did not measure is left out; none in common gives None.
    gap = harness.against_reference(
        {"config": "every", "round_ratios": "2.0000;;3.0000"},
        {"config": "every", "round_ratios": ";1.5000;1.5000"},
    )
    assert gap == {"median": 2.0, "min": 2.0, "max": 2.0}
    assert (
        harness.against_reference(
            {"config": "every", "round_ratios": "2.0000;"},
            {"config": "every", "round_ratios": ";1.5000"},
        )
        is None
    )
    # The finalization has no bare step: its seconds are compared.
    finalize = harness.against_reference(
        {"config": "finalize", "round_removal_s": "1.0000;3.0000"},
        {"config": "finalize", "round_removal_s": "2.0000;2.0000"},
    )
    assert finalize == {"median": 1.0, "min": 0.5, "max": 1.5}


def test_reference_python_runs_a_second_tree_in_the_same_rounds(tmp_path: Path) -> None:
    # The reference interpreter is this one here (a real comparison passes another tree's venv):
    # every observed configuration runs once per tree, and the before/after table is printed.
    done, output = _quick_sequence_run(
        tmp_path, "bare,every-memory", "--reference-python", sys.executable
    )
    with output.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["impl"], r["config"], r["sink"]) for r in rows] == [
        ("-", "bare", "-"),
        ("ti", "every", "memory"),
        ("ti-ref", "every", "memory"),
    ]
    assert all(r["error"] == "" and float(r["ratio"]) > 0 for r in rows[1:])
    assert all(int(r["history_rows"]) > 0 for r in rows[1:])
    assert "This tree (ti) against the reference tree (ti-ref)" in done.stdout
    table = done.stdout.split("This tree (ti) against the reference tree (ti-ref)")[1]
    assert table.count("sequence") == 1


def _benchmark(tmp_path: Path, script: str, *args: str) -> list[str]:
    """The output lines of ``benchmarks/<script>`` run with ``args`` (it must succeed)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout.strip().splitlines()


def _sentinel_parts(tmp_path: Path, mode: str) -> list[str]:
    """The output lines of benchmarks/sentinel_parts.py ``mode`` on one round of two steps."""
    return _benchmark(tmp_path, "sentinel_parts.py", mode, "--rounds", "1", "--steps", "2")


def test_sentinel_parts_times_every_eager_variant(tmp_path: Path) -> None:
    """benchmarks/sentinel_parts.py eager runs end to end on one short round and prints a
    ratio for each variant (no timing is asserted)."""
    lines = _sentinel_parts(tmp_path, "eager")
    assert lines[0].startswith("eager sequence: bare step ")
    variants = {line.split()[0]: line for line in lines[1:]}
    assert set(variants) == {
        "unsampled",
        "sentinel",
        "sum-check",
        "no-kernel",
        "no-add",
        "no-gradient-call",
    }
    for line in variants.values():
        assert float(line.split()[1].rstrip("x")) > 0


def test_sentinel_parts_times_every_reduction_inside_the_step(tmp_path: Path) -> None:
    """benchmarks/sentinel_parts.py kernels runs end to end on one short round and prints a
    time per checked tensor for each exact reduction (no timing is asserted)."""
    lines = _sentinel_parts(tmp_path, "kernels")
    assert lines[0].startswith("kernels sequence: per checked tensor inside the step")
    names = [line.split(" median ")[0].strip() for line in lines[1:]]
    assert names == ["cpu_nonfinite", "dot", "sum", "numpy sum", "abs max", "aminmax"]
    for line in lines[1:]:
        assert float(line.split(" median ")[1].split()[0]) > 0


def test_sentinel_replay_benchmark_times_each_variant_and_a_replay(tmp_path: Path) -> None:
    """benchmarks/sentinel_replay.py runs end to end on one short round of the eager workload:
    a ratio for the observer, replay mode and dense mode, the target line, and the cost of one
    replay (no timing is asserted)."""
    lines = _benchmark(
        tmp_path, "sentinel_replay.py", "--workloads", "sequence", "--rounds", "1", "--steps", "2"
    )
    assert lines[0].startswith("sequence (eager): bare step ")
    variants = {line.split()[0]: line for line in lines[1:4]}
    assert set(variants) == {"observer", "replay", "dense"}
    for line in variants.values():
        assert float(line.split()[1].rstrip("x")) > 0
    assert lines[4].startswith("  target: replay <= 1.03x: ")
    assert lines[5].startswith("  one replay, at an event: forward ")


def test_tensor_parallel_benchmark_times_every_variant(tmp_path: Path) -> None:
    """benchmarks/tensor_parallel.py runs a 2-rank gloo job end to end on one short round: a
    time per variant and the three ratios (no timing is asserted)."""
    lines = _benchmark(
        tmp_path, "tensor_parallel.py", "--dim", "64", "--rounds", "1", "--steps", "2"
    )
    assert lines[0].startswith("tensor-parallel MLP, d=64, batch 64, 2 gloo ranks")
    times = {line.split("  ")[1].strip(): line for line in lines[1:6]}
    assert set(times) == {"tp bare", "tp unsampled", "tp sampled", "local bare", "local sampled"}
    ratios = lines[6:9]
    assert [r.split(":")[0].strip() for r in ratios] == [
        "tp unsampled / tp bare",
        "tp sampled / tp bare",
        "local sampled / local bare",
    ]
    for line in ratios:
        assert float(line.split(":")[1].split("x")[0]) > 0


def test_stability_benchmark_times_every_variant(tmp_path: Path) -> None:
    """benchmarks/stability.py runs end to end on one round of the sequence workload: a ratio
    per variant and the added costs (no timing is asserted)."""
    lines = _benchmark(
        tmp_path, "stability.py", "--workloads", "sequence", "--rounds", "1", "--steps", "1"
    )
    assert lines[0].startswith("sequence: bare step with AdamW ")
    labels = [line.split("  ")[1].strip() for line in lines[1:5]]
    assert labels == ["default", "+stability", "+optimizer_state", "unsampled +both"]
    for line in lines[1:5]:
        assert float(line.split()[-3].rstrip("x")) > 0
    assert lines[5].startswith("  added to a sampled step: stability ")


def test_reading_benchmark_times_every_reader_beside_duckdb(tmp_path: Path) -> None:
    """benchmarks/reading.py on a tiny run of one rank and of three ranks: a row per reader,
    each with a time and a peak RSS, DuckDB's beside it where it has one (no timing asserted),
    and the CSV it promises."""
    pytest.importorskip("duckdb")
    output = tmp_path / "reading.csv"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "reading.py"),
            "--sizes",
            "150k",
            "--ranks",
            "3x30k",
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    with output.open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    commands = [row["command"] for row in rows]
    assert commands == [
        "finalization (remove_observer: the sink's close())",
        "ti consolidate (killed run)",
        "ti summary --csv",
        "ti compare --csv (two runs)",
        "ti report (one run)",
        "ti validate",
        "ti drift",
        'compare_ranks(metric="std", only_standouts=True)',
        "combine_shards",
    ]
    for row in rows:
        assert float(row["seconds"]) > 0, row
        assert float(row["peak_mb"]) > 0, row
        assert "failed" not in row["note"], row
    with_reference = [row for row in rows if row["reference"]]
    assert len(with_reference) == 7
    assert all(float(row["reference_seconds"]) > 0 for row in with_reference)
