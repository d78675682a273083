"""TorchInstruments benchmark harness: the observer's cost against the bare step.

Every configuration runs in its own fresh process (benchmarks/worker.py) with one intra-op
thread. Configurations: ``bare`` (no observer), ``unsampled`` (attached; the one sampled first
forward is in the warmup), ``every`` (AlwaysSampler), ``every`` with ``MemorySink``, and
``interval`` (the default 60-s TimedSampler over N steps, first sample included), and
``precision3`` (``every`` with three ``precision=`` formats). A workload's
configurations run in ``--rounds`` interleaved rounds (alternately forward and reversed order),
a fresh process each per round; a ratio is the median over rounds of the configuration's time
over the same round's bare time, so a drift of the machine's speed over minutes mostly cancels
out of it. Reports medians, ratios to the bare step with their spread over rounds, removal time,
peak RSS and history rows, with the targets (benchmarks/README.md) and PASS/FAIL; writes a CSV
(benchmarks/results/<timestamp>.csv unless --output).

    python benchmarks/run.py                       # every workload, full plan
    python benchmarks/run.py --targets             # the sampled-step targets, 5 rounds
    python benchmarks/run.py --quick               # smoke run (one round)
    python benchmarks/run.py --workloads sequence --configs bare,unsampled --rounds 5
    python benchmarks/run.py --workloads sequence,many --repeats 9
    python benchmarks/run.py --device cuda         # synchronized timings, device memory, syncs

When ``torchinstruments`` (the released 0.8.0 wheel) is importable by ``--baseline-python``
(default: this interpreter), it runs on the same workloads and its ratios print side by side.
Each target line also gives the bare step time of its workload (median and range over rounds):
a fixed observer cost is a larger share of a fast bare step, so a reader can see which end of
the machine's speed the run was at.

``--reference-python PY`` measures a second ti-core, the one PY imports (for example a venv
holding another commit's packages), as impl ``ti-ref`` in the same interleaved rounds, with the
same harness and workloads, and prints a before/after table: per round, this tree's ratio over
the reference's (both against the same bare step), so "is this change slower?" is answered in
one run:

    git worktree add /tmp/before <commit> && python -m venv /tmp/before-venv
    /tmp/before-venv/bin/pip install -c constraints/torch.txt psutil numpy \
        /tmp/before/packages/ti-schema /tmp/before/packages/ti-core /tmp/before/packages/ti-io
    python benchmarks/run.py --no-baseline --reference-python /tmp/before-venv/bin/python
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workloads  # noqa: E402

WORKLOADS = ("sequence", "many", "large", "history", "conv", "transformer")
NAMED_ONLY = ("gpt2",)
"""Workloads run only when ``--workloads`` names them (GPT-2 small's size: seconds per step)."""
CONFIGS = ("bare", "unsampled", "every", "every-memory", "interval", "precision3", "sentinel")
HISTORY_ROWS, HISTORY_ROWS_QUICK = 900_000, 90_000
BASELINE, REFERENCE = workloads.BASELINE, workloads.REFERENCE

COLUMNS = (
    "run",
    "workload",
    "impl",
    "config",
    "sink",
    "device",
    "warmup",
    "steps_timed",
    "step_ms_median",
    "step_ms_mean",
    "step_ms_min",
    "ratio",
    "ratio_basis",
    "ratio_of_min",
    "removal_s",
    "inject_s",
    "peak_rss_mb",
    "rss_growth_mb",
    "tensor_mb",
    "history_rows",
    "exact_quartiles",
    "quartile_abs_err",
    "peak_device_mb",
    "syncs_per_step",
    "targets",
    "status",
    "error",
    # Added with --rounds; the columns above keep their meaning (now aggregated over rounds).
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


@dataclass(frozen=True)
class Target:
    """One target: ``value(row, bare) <= limit`` on the ``ti`` row of ``workload``/``config``
    with ``sink``."""

    workload: str
    config: str
    label: str
    limit: float
    unit: str  # "x" ratio to bare, "s", "MB", or "bool"
    sink: str = "dir"

    def value(self, row: dict[str, Any], bare: dict[str, Any] | None) -> float | None:
        if self.unit == "x":
            return _float(row.get("ratio"))
        if self.label.startswith("removal") or self.label.startswith("finalize"):
            return _float(row.get("removal_s"))
        if self.label.startswith("peak RSS"):  # growth over bare, in units of the tensor
            if bare is None or _float(row.get("tensor_mb")) in (None, 0.0):
                return None
            growth = float(row["peak_rss_mb"]) - float(bare["peak_rss_mb"])
            return growth / float(row["tensor_mb"])
        if self.label.startswith("RSS growth"):
            return _float(row.get("rss_growth_mb"))
        if self.unit == "bool":
            got = row.get("exact_quartiles")
            return None if got in (None, "") else (0.0 if got in (True, "True") else 1.0)
        return None

    def describe(self) -> str:
        if self.unit == "bool":
            return self.label
        if self.label.startswith("peak RSS"):
            return f"{self.label} <= bare + {self.limit:g}x tensor"
        suffix = "x" if self.unit == "x" else f" {self.unit}"
        return f"{self.label} <= {self.limit:g}{suffix}"


# The sampled-step targets (every forward) replace the first ones (<= 4x / 40x / 3x, RSS <= bare
# + 3x tensor); the first unsampled, interval, removal and finalization targets stand.
# Every-forward targets are checked with the directory sink (what ``output_dir=`` gives) and,
# as a separate line, with MemorySink (ti-core's own cost, without ti-io's Parquet parts).
TARGETS = (
    Target("sequence", "unsampled", "unsampled", 1.02, "x"),
    Target("sequence", "every", "every forward", 3.0, "x"),
    Target("sequence", "every", "every forward, MemorySink", 3.0, "x", "memory"),
    Target("sequence", "interval", "60-s interval", 1.01, "x"),
    Target("many", "unsampled", "unsampled", 1.05, "x"),
    Target("many", "every", "every forward", 8.0, "x"),
    Target("many", "every", "every forward, MemorySink", 8.0, "x", "memory"),
    Target("many", "unsampled", "removal", 0.5, "s"),
    Target("many", "interval", "removal", 0.5, "s"),
    # large reduces two 64 MiB tensors a sampled step since its output's gradient is recorded
    # (a leaf's gradient, once a gap row): the first target's 1.5x was for one, so 0.5x each.
    Target("large", "every", "every forward (2 tensors)", 2.0, "x"),
    Target("large", "every", "every forward (2 tensors), MemorySink", 2.0, "x", "memory"),
    Target("large", "every", "exact quartiles", 0.0, "bool"),
    Target("large", "every", "peak RSS", 2.0, "MB"),
    Target("history", "finalize", "finalize (consolidation + result.json)", 2.0, "s"),
    Target("history", "finalize", "RSS growth", 200.0, "MB"),
    # The flight recorder's default (replay mode: checks at the root), unsampled forwards; the
    # figures that decide are sentinel_replay.py's, side by side in one process.
    Target("sequence", "sentinel", "sentinel, unsampled", 1.03, "x"),
    Target("gpt2", "sentinel", "sentinel, unsampled", 1.02, "x"),
)
TARGETS_PRESET = {
    "workloads": ["sequence", "many", "large"],
    "configs": ["bare", "every", "every-memory", "interval"],
    "rounds": 5,
}
"""``--targets``: the sampled-step targets (and the 60-s interval beside them)."""
FAST_BARE_MS = {"sequence": 1.3}
"""Bare step at the fast end of the reference machine the sampled-step targets were set on,
shown beside the run's."""


def _float(value: Any) -> float | None:
    if value in (None, ""):
        return None
    return float(value)


def _baseline_available(python: str) -> bool:
    probe = (
        "import importlib.util,sys; sys.exit(importlib.util.find_spec('torchinstruments') is None)"
    )
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def _run_worker(python: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    cmd = [python, str(HERE / "worker.py"), json.dumps(spec)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            if "traceback" in result:
                sys.stderr.write(result.pop("traceback"))
            return result
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"error": f"worker exited {done.returncode}: {' | '.join(tail)}"}


def _ti_core_at(python: str) -> str:
    """Where ``python`` imports ti_core from (so a reader sees which trees were compared)."""
    probe = "import ti_core, os; print(os.path.dirname(ti_core.__file__))"
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "ti_core not importable"


def against_reference(row: dict[str, Any], ref: dict[str, Any]) -> dict[str, float] | None:
    """This tree's cost over the reference tree's for one configuration: per round, its ratio to
    bare over the reference's ratio to the same round's bare (so the bare step cancels), or for
    the ``history`` finalization (no bare step) its finalize time over the reference's; the
    median over rounds and the rounds' min-max. None without a round where both measured."""
    key = "round_removal_s" if row["config"] == "finalize" else "round_ratios"

    def per_round(r: dict[str, Any]) -> list[float | None]:
        return [float(v) if v else None for v in str(r.get(key) or "").split(";")]

    pairs = [
        a / b
        for a, b in zip(per_round(row), per_round(ref), strict=False)
        if a is not None and b is not None and b > 0
    ]
    if not pairs:
        return None
    return {"median": statistics.median(pairs), "min": min(pairs), "max": max(pairs)}


def _print_reference(rows: list[dict[str, Any]]) -> None:
    """The before/after table of ``--reference-python``: one line per configuration."""
    print(f"\nThis tree (ti) against the reference tree ({REFERENCE}), same rounds, same bare step")
    print(
        f"  {'workload':<12}{'config':<14}{'sink':<7}{'ti':>9}{REFERENCE:>9}{'ti/ref':>9}  rounds"
    )
    for row in rows:
        if row["impl"] != "ti":
            continue
        ref = next(
            (
                r
                for r in rows
                if r["impl"] == REFERENCE
                and (r["workload"], r["config"], r["sink"], r["device"])
                == (row["workload"], row["config"], row["sink"], row["device"])
            ),
            None,
        )
        if ref is None:
            continue
        got = against_reference(row, ref)
        change = "-" if got is None else f"{got['median']:.3f}"
        spread = "-" if got is None else f"{got['min']:.3f}-{got['max']:.3f}"
        print(
            f"  {row['workload']:<12}{row['config']:<14}{row['sink']:<7}"
            f"{_cost(row):>9}{_cost(ref):>9}{change:>9}  {spread}"
        )
    print(
        "(ti, ti-ref: ratio to bare, or finalize seconds; ti/ref < 1: this tree is cheaper, per"
        " round against that round's bare step; rounds: min-max of ti/ref)"
    )


def _cost(row: dict[str, Any]) -> str:
    if row["config"] == "finalize":
        return _fmt(row.get("removal_s"), ".2f") + "s"
    return _fmt(row.get("ratio"), ".3f")


def _plan(args: argparse.Namespace, workload: str) -> dict[str, Any]:
    base = workloads.QUICK if args.quick else workloads.DEFAULTS[workload]
    return {
        "warmup": args.warmup if args.warmup is not None else base.warmup,
        "steps": args.steps or base.steps,
        "every_steps": args.every_steps or base.every_steps,
        "repeats": args.repeats or base.repeats,
        "interval_steps": args.interval_steps or base.interval_steps,
    }


def _row(run_id: str, spec: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "run": run_id,
        "workload": spec["workload"],
        "impl": spec.get("impl", "-") if spec["config"] != "bare" else "-",
        "config": spec["label"],
        "sink": spec.get("sink", "-") if spec["config"] != "bare" else "-",
        "device": spec.get("device", "cpu"),
        "warmup": spec.get("warmup", ""),
        "error": got.get("error", ""),
    }
    for key in ("median", "mean", "min"):
        if f"step_s_{key}" in got:
            row[f"step_ms_{key}"] = round(got[f"step_s_{key}"] * 1e3, 4)
    for key in (
        "steps_timed",
        "removal_s",
        "inject_s",
        "peak_rss_mb",
        "rss_growth_mb",
        "tensor_mb",
        "history_rows",
        "exact_quartiles",
        "quartile_abs_err",
        "peak_device_mb",
        "syncs_per_step",
    ):
        value = got.get(key)
        if isinstance(value, float):
            value = round(value, 4) if key != "quartile_abs_err" else f"{value:.3g}"
        if value is not None:
            row[key] = value
    return row


# Per-process figures whose aggregate is the median over rounds (counts: median_low, so the
# aggregate is a value some round observed).
_MEDIAN_KEYS = ("removal_s", "inject_s", "peak_rss_mb", "rss_growth_mb", "peak_device_mb")
_COUNT_KEYS = ("steps_timed", "history_rows", "syncs_per_step")
# Configurations whose history rows the plan fixes (count-based samplers; finalize's synthetic
# history). The 60-s interval's depend on the clock, so they may differ between rounds.
_DETERMINISTIC_ROWS = ("unsampled", "every", "precision3", "sentinel", "finalize")


def round_order(items: list[Any], index: int) -> list[Any]:
    """The order of round ``index`` (0-based): forward in even rounds, reversed in odd ones.

    A configuration that runs after bare in one round runs before it in the next, so a steady
    drift of the machine's speed biases its per-round ratios in opposite directions.
    """
    return list(items) if index % 2 == 0 else list(reversed(items))


def _measured(got: dict[str, Any] | None) -> bool:
    return got is not None and "error" not in got


def combine_rounds(results: list[dict[str, Any] | None]) -> dict[str, Any]:
    """One configuration's worker results, one per round (None: not run), as one result.

    Step times: median of the rounds' medians, mean of their means (every round times the same
    blocks), min of their mins. Other figures: median over rounds; ``exact_quartiles`` holds only
    if every round found them exact. Errors are kept per round; the rounds that measured still
    count.
    """
    done = [got for got in results if got is not None and _measured(got)]
    errors = [
        f"round {i + 1}: {got['error']}"
        for i, got in enumerate(results)
        if got is not None and not _measured(got)
    ]
    combined: dict[str, Any] = {"error": "; ".join(errors)} if errors else {}
    if not done:
        return combined

    def present(key: str) -> list[Any]:
        return [got[key] for got in done if got.get(key) is not None]

    for key, how in (
        ("step_s_median", statistics.median),
        ("step_s_mean", statistics.fmean),
        ("step_s_min", min),
    ):
        if values := present(key):
            combined[key] = how(values)
    for key in _MEDIAN_KEYS:
        if values := present(key):
            combined[key] = statistics.median(values)
    for key in _COUNT_KEYS:
        if values := present(key):
            combined[key] = statistics.median_low(values)
    if values := present("tensor_mb"):
        combined["tensor_mb"] = values[0]
    if values := present("exact_quartiles"):
        combined["exact_quartiles"] = all(value is True for value in values)
    if values := present("quartile_abs_err"):
        combined["quartile_abs_err"] = max(values)
    return combined


def round_ratios(
    config: str,
    results: list[dict[str, Any] | None],
    bare: list[dict[str, Any] | None],
) -> dict[str, Any]:
    """Ratio columns of one configuration against bare, round by round.

    Each round's ratio divides the configuration's time by the bare time of the *same* round
    (time-adjacent processes); ``ratio`` and ``ratio_of_min`` are the medians of those per-round
    ratios and ``ratio_min``/``ratio_max`` their spread. Medians of block times, or means for
    ``interval`` (its cost is the amortized one: a median would hide the sampled step).
    """
    basis = "mean" if config == "interval" else "median"
    key = f"step_s_{basis}"
    ratios: list[float | None] = []
    of_min: list[float | None] = []
    for got, ref in zip(results, bare, strict=True):
        if got is None or ref is None or "error" in got or "error" in ref or key not in got:
            ratios.append(None)
            of_min.append(None)
            continue
        ratios.append(got[key] / ref[key])
        of_min.append(got["step_s_min"] / ref["step_s_min"])
    columns: dict[str, Any] = {
        "round_ratios": ";".join("" if r is None else f"{r:.4f}" for r in ratios),
        "round_ratios_of_min": ";".join("" if r is None else f"{r:.4f}" for r in of_min),
    }
    measured = [r for r in ratios if r is not None]
    if measured:
        columns["ratio"] = round(statistics.median(measured), 4)
        columns["ratio_basis"] = basis
        columns["ratio_min"] = round(min(measured), 4)
        columns["ratio_max"] = round(max(measured), 4)
        columns["ratio_of_min"] = round(statistics.median([r for r in of_min if r is not None]), 4)
    return columns


def _round_columns(config: str, results: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The per-round figures behind the aggregate, ';'-joined in round order ('' = no value)."""

    def joined(key: str, scale: float = 1.0) -> str:
        if all(got is None or got.get(key) is None for got in results):
            return ""
        return ";".join(
            ""
            if got is None or got.get(key) is None
            else (f"{got[key] * scale:.4f}" if isinstance(got[key], float) else str(got[key]))
            for got in results
        )

    columns: dict[str, Any] = {
        "rounds": sum(_measured(got) for got in results),
        "round_step_ms_median": joined("step_s_median", 1e3),
        "round_removal_s": joined("removal_s"),
        "round_history_rows": joined("history_rows"),
    }
    rows = {got["history_rows"] for got in results if got and got.get("history_rows") is not None}
    if config in _DETERMINISTIC_ROWS and len(rows) > 1:
        columns["note"] = f"history rows differ across rounds: {columns['round_history_rows']}"
    return columns


def aggregate(
    run_id: str,
    spec: dict[str, Any],
    results: list[dict[str, Any] | None],
    bare: list[dict[str, Any] | None] | None,
) -> dict[str, Any]:
    """The CSV/table row of one configuration from its per-round results (and bare's)."""
    row = _row(run_id, spec, combine_rounds(results))
    row.update(_round_columns(spec["config"], results))
    if bare is not None and spec["config"] != "bare":
        row.update(round_ratios(spec["config"], results, bare))
    return row


def _apply_targets(rows: list[dict[str, Any]]) -> list[tuple[Target, dict[str, Any], str, str]]:
    """Check each target against its ``ti`` row; returns (target, row, value text, status)."""
    checks = []
    bare = {(r["workload"], r["device"]): r for r in rows if r["config"] == "bare"}
    for row in rows:
        if row["impl"] not in ("ti", "-") or row["config"] == "bare":
            continue
        texts, statuses = [], []
        for target in TARGETS:
            if (target.workload, target.config, target.sink) != (
                row["workload"],
                row["config"],
                row.get("sink"),
            ):
                continue
            if row["device"] != "cpu" and target.unit != "x":
                continue
            value = target.value(row, bare.get((row["workload"], row["device"])))
            if row.get("error") or value is None:
                status, shown = "n/a", "-"
            else:
                status = "PASS" if value <= target.limit else "FAIL"
                if target.unit == "bool":
                    shown = "yes" if value == 0.0 else "no"
                elif target.label.startswith("peak RSS"):
                    shown = f"+{value:.2f}x tensor"
                else:
                    shown = f"{value:.3g}{'x' if target.unit == 'x' else ' ' + target.unit}"
            checks.append((target, row, shown, status))
            texts.append(target.describe())
            statuses.append(status)
        if texts:
            row["targets"] = "; ".join(texts)
            row["status"] = (
                "FAIL" if "FAIL" in statuses else "PASS" if "PASS" in statuses else "n/a"
            )
    return checks


def bare_speed(rows: list[dict[str, Any]], workload: str, device: str) -> str:
    """The bare step of ``workload`` in this run: median over rounds and their range."""
    bare = next(
        (
            r
            for r in rows
            if r["config"] == "bare" and (r["workload"], r["device"]) == (workload, device)
        ),
        None,
    )
    if bare is None or bare.get("step_ms_median") in (None, ""):
        return ""
    rounds = [float(v) for v in str(bare.get("round_step_ms_median") or "").split(";") if v]
    spread = f" ({min(rounds):.3g}-{max(rounds):.3g})" if len(rounds) > 1 else ""
    fast = FAST_BARE_MS.get(workload)
    reference = f", fast end ~{fast:g} ms" if fast is not None else ""
    return f"bare {float(bare['step_ms_median']):.3g} ms{spread}{reference}"


def _fmt(value: Any, spec: str = "") -> str:
    if value in (None, ""):
        return "-"
    return format(value, spec) if spec else str(value)


def _sig3(value: float) -> str:
    """Three significant digits in fixed notation (5.00, 12.9, 144, 1028)."""
    decimals = 2 - math.floor(math.log10(abs(value))) if value else 2
    return f"{value:.{max(0, decimals)}f}"


def _spread(row: dict[str, Any]) -> str:
    """The per-round ratios' min-max, or '-' with fewer than two rounds' ratios."""
    measured = [r for r in str(row.get("round_ratios") or "").split(";") if r]
    if len(measured) < 2:
        return "-"
    return f"{_sig3(row['ratio_min'])}-{_sig3(row['ratio_max'])}"


def _print_table(rows: list[dict[str, Any]], checks: list[Any], baseline_ratios: bool) -> None:
    header = (
        f"{'workload':<12}{'impl':<10}{'config':<14}{'sink':<7}{'median ms':>11}{'ratio':>9}"
        f"{'spread':>14}{'min-ratio':>10}"
        f"{'removal s':>11}{'peak RSS MB':>13}{'rows':>10}  note"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = _fmt(r.get("ratio"), ".3f")
        if r.get("ratio_basis") == "mean":
            ratio += "m"
        note = " ".join(filter(None, (r.get("error"), r.get("note"))))
        note += " " if note else ""
        if r.get("exact_quartiles") not in (None, ""):
            note += f"exact quartiles: {r['exact_quartiles']} "
        if r.get("syncs_per_step") not in (None, ""):
            note += f"syncs/step: {r['syncs_per_step']} dev MB: {r.get('peak_device_mb')} "
        if r["workload"] == "history":
            note += f"RSS growth {r.get('rss_growth_mb')} MB"
        print(
            f"{r['workload']:<12}{r['impl']:<10}{r['config']:<14}{r['sink']:<7}"
            f"{_fmt(r.get('step_ms_median'), '.3f'):>11}{ratio:>9}{_spread(r):>14}"
            f"{_fmt(r.get('ratio_of_min'), '.3f'):>10}"
            f"{_fmt(r.get('removal_s'), '.3f'):>11}{_fmt(r.get('peak_rss_mb'), '.0f'):>13}"
            f"{_fmt(r.get('history_rows')):>10}  {note[:60]}"
        )
    print(
        "(per round: the configuration's median block time over the same round's bare one, 'm':"
        " means, the amortized interval cost; ratio: the median over rounds, spread: the"
        " rounds' min-max; min-ratio: fastest block vs fastest bare block, median over rounds;"
        " median ms, removal s, peak RSS MB, rows: medians over rounds)\n"
    )
    print("Targets (why each limit: benchmarks/README.md)")
    width = max((len(c[0].describe()) for c in checks), default=20) + 2
    for target, row, shown, status in checks:
        other = ""
        if baseline_ratios and target.unit == "x":
            base = next(
                (
                    b
                    for b in rows
                    if b["impl"] == BASELINE
                    and (b["workload"], b["config"], b["device"])
                    == (row["workload"], row["config"], row["device"])
                ),
                None,
            )
            if base is not None:
                other = f"   {BASELINE}: {_fmt(base.get('ratio'), '.3g')}x"
        if target.unit == "x" and _spread(row) != "-":
            other = f"   rounds {_spread(row)}{other}"
        if target.unit == "x":
            speed = bare_speed(rows, row["workload"], row["device"])
            other += f"   [{speed}]" if speed else ""
        print(f"  {row['workload']:<10}{target.describe():<{width}}{shown:>16}   {status}{other}")


def _specs(args: argparse.Namespace, baseline: bool) -> list[list[dict[str, Any]]]:
    """The specs of each workload, in the order of its first round (bare first by default)."""
    groups: list[list[dict[str, Any]]] = []
    for workload in args.workloads:
        specs: list[dict[str, Any]] = []
        groups.append(specs)
        if workload == "history":
            rows = args.history_rows or (HISTORY_ROWS_QUICK if args.quick else HISTORY_ROWS)
            for impl in ["ti", *([REFERENCE] if args.reference_python else [])]:
                specs.append(
                    {
                        "workload": "history",
                        "config": "finalize",
                        "label": "finalize",
                        "impl": impl,
                        "sink": "dir",
                        "rows": rows,
                        "device": "cpu",
                    }
                )
            continue
        plan = _plan(args, workload)
        impls = [
            "ti",
            *([REFERENCE] if args.reference_python else []),
            *([BASELINE] if baseline else []),
        ]
        for config in args.configs:
            for impl in impls if config != "bare" else ["ti"]:
                if config in ("every-memory", "precision3", "sentinel") and impl == BASELINE:
                    continue  # 0.8.0 has no MemorySink, precision profile or sentinel
                base_config, sink = (
                    ("every", "memory") if config == "every-memory" else (config, "dir")
                )
                specs.append(
                    {
                        "workload": workload,
                        "config": base_config,
                        "label": base_config,
                        "impl": impl,
                        "sink": sink,
                        "device": args.device,
                        **plan,
                    }
                )
    return groups


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workloads",
        help=f"comma-separated subset of {','.join(WORKLOADS + NAMED_ONLY)} (default: all but "
        f"{','.join(NAMED_ONLY)})",
    )
    parser.add_argument(
        "--configs", help=f"comma-separated subset of {','.join(CONFIGS)} (default: all)"
    )
    parser.add_argument("--repeats", type=int, help="timed blocks per configuration")
    parser.add_argument("--steps", type=int, help="steps per timed block")
    parser.add_argument("--every-steps", type=int, help="steps per block when sampling every one")
    parser.add_argument("--interval-steps", type=int, help="steps of the 60-s interval config")
    parser.add_argument("--warmup", type=int, help="untimed steps before timing")
    parser.add_argument("--history-rows", type=int, help="rows of the history workload")
    parser.add_argument(
        "--rounds",
        type=int,
        help="interleaved rounds per workload, each configuration in a fresh process per round "
        "(default 3; 1 with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny plan and one round: a smoke run")
    parser.add_argument(
        "--targets",
        action="store_true",
        help="the sampled-step targets: workloads "
        f"{','.join(TARGETS_PRESET['workloads'])}, configs {','.join(TARGETS_PRESET['configs'])}, "
        f"{TARGETS_PRESET['rounds']} rounds (explicit --workloads/--configs/--rounds win)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (synchronized timings)")
    parser.add_argument("--output", type=Path, help="CSV path (default benchmarks/results/)")
    parser.add_argument(
        "--baseline-python",
        default=sys.executable,
        help="interpreter that can import torchinstruments 0.8.0",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip torchinstruments")
    parser.add_argument(
        "--reference-python",
        help=f"interpreter whose ti_core (another tree's install) runs as impl {REFERENCE!r} "
        "beside this one, with a before/after table",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    args = parser.parse_args(argv)
    preset: dict[str, Any] = TARGETS_PRESET if args.targets else {}
    workloads_arg = args.workloads or ",".join(preset.get("workloads", WORKLOADS))
    configs_arg = args.configs or ",".join(preset.get("configs", CONFIGS))
    args.workloads = [w for w in workloads_arg.split(",") if w]
    args.configs = [c for c in configs_arg.split(",") if c]
    if args.rounds is None and preset:
        args.rounds = preset["rounds"]
    for name in args.workloads:
        if name not in WORKLOADS + NAMED_ONLY:
            parser.error(
                f"--workloads: unknown {name!r}; choose from {','.join(WORKLOADS + NAMED_ONLY)}"
            )
    for name in args.configs:
        if name not in CONFIGS:
            parser.error(f"--configs: unknown {name!r}; choose from {','.join(CONFIGS)}")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    if "bare" not in args.configs:
        args.configs.insert(0, "bare")  # every ratio needs it
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_id = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    baseline = not args.no_baseline and _baseline_available(args.baseline_python)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(
        f"TorchInstruments benchmarks {run_id}: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load {load and ' '.join(f'{x:.2f}' for x in load)}, "
        f"python {platform.python_version()}, device {args.device}"
    )
    print(
        f"baseline {BASELINE}: "
        + (f"yes ({args.baseline_python})" if baseline else "not importable, skipped")
    )
    if args.reference_python:
        print(
            f"reference {REFERENCE}: {args.reference_python} ({_ti_core_at(args.reference_python)})"
        )
        print(f"this tree ti: {sys.executable} ({_ti_core_at(sys.executable)})")
    print(f"{args.rounds} round(s) per workload, alternately in forward and reversed order")
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for group in _specs(args, baseline):
        if hasattr(os, "getloadavg"):
            print(f"{group[0]['workload']}: load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        # results[i][r]: the worker result of group[i] in round r (None until it ran).
        results: list[list[dict[str, Any] | None]] = [[None] * args.rounds for _ in group]
        for index in range(args.rounds):
            for i in round_order(list(range(len(group))), index):
                spec = group[i]
                python = {BASELINE: args.baseline_python, REFERENCE: args.reference_python}.get(
                    spec.get("impl", "ti"), sys.executable
                )
                label = f"{spec['workload']}/{spec['config']}/{spec.get('impl')}/{spec.get('sink')}"
                print(f"  round {index + 1}/{args.rounds} {label} ...", end="", flush=True)
                t0 = time.perf_counter()
                got = _run_worker(python, spec, args.timeout)
                error = f"  ERROR {got['error']}" if "error" in got else ""
                print(f" {time.perf_counter() - t0:.1f} s{error}")
                results[i][index] = got
        bare = next((results[i] for i, sp in enumerate(group) if sp["config"] == "bare"), None)
        rows += [aggregate(run_id, spec, results[i], bare) for i, spec in enumerate(group)]
    checks = _apply_targets(rows)
    print()
    _print_table(rows, checks, baseline)
    if args.reference_python:
        _print_reference(rows)
    output = args.output or HERE / "results" / f"{run_id}.csv"
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(row)
    load_end = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(
        f"\nwrote {output} ({len(rows)} rows) in {time.perf_counter() - started:.0f} s; "
        f"load at end {load_end and ' '.join(f'{x:.2f}' for x in load_end)}"
    )
    failed = sum(status == "FAIL" for *_, status in checks)
    print(f"{failed} target(s) failed" if failed else "all targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
