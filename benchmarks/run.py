"""TorchInstruments benchmark harness (issue 7): cost of the observer relative to the bare step.

Every configuration runs in its own fresh process (benchmarks/worker.py) with one intra-op
thread. Configurations: ``bare`` (no observer), ``unsampled`` (attached; the one sampled first
forward is in the warmup), ``every`` (AlwaysSampler), ``every`` with ``MemorySink``, and
``interval`` (the default 60-s TimedSampler over N steps, first sample included). Reports medians,
ratios to the bare step, removal time, peak RSS and history rows, with the issue's targets and
PASS/FAIL; writes a CSV (benchmarks/results/<timestamp>.csv unless --output).

    python benchmarks/run.py                       # every workload, full plan
    python benchmarks/run.py --quick               # smoke run
    python benchmarks/run.py --workloads sequence,many --repeats 9
    python benchmarks/run.py --device cuda         # synchronized timings, device memory, syncs

When ``torchinstruments`` (the released 0.8.0 wheel) is importable by ``--baseline-python``
(default: this interpreter), it runs on the same workloads and its ratios print side by side.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
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
CONFIGS = ("bare", "unsampled", "every", "every-memory", "interval")
HISTORY_ROWS, HISTORY_ROWS_QUICK = 900_000, 90_000
BASELINE = "ti-0.8.0"

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
)


@dataclass(frozen=True)
class Target:
    """One target of issue 7: ``value(row, bare) <= limit``."""

    workload: str
    config: str
    label: str
    limit: float
    unit: str  # "x" ratio to bare, "s", "MB", or "bool"

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


TARGETS = (
    Target("sequence", "unsampled", "unsampled", 1.02, "x"),
    Target("sequence", "every", "every forward", 4.0, "x"),
    Target("sequence", "interval", "60-s interval", 1.01, "x"),
    Target("many", "unsampled", "unsampled", 1.05, "x"),
    Target("many", "every", "every forward", 40.0, "x"),
    Target("many", "unsampled", "removal", 0.5, "s"),
    Target("many", "interval", "removal", 0.5, "s"),
    Target("large", "every", "every forward", 3.0, "x"),
    Target("large", "every", "exact quartiles", 0.0, "bool"),
    Target("large", "every", "peak RSS", 3.0, "MB"),
    Target("history", "finalize", "finalize (consolidation + result.json)", 2.0, "s"),
    Target("history", "finalize", "RSS growth", 200.0, "MB"),
)


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


def _apply_ratios(rows: list[dict[str, Any]]) -> None:
    """Ratio to the same workload's bare step: medians; means for the interval (amortized)."""
    bare = {(r["workload"], r["device"]): r for r in rows if r["config"] == "bare"}
    for row in rows:
        ref = bare.get((row["workload"], row["device"]))
        if ref is None or row["config"] == "bare" or "step_ms_median" not in row:
            continue
        if "step_ms_median" not in ref:
            continue
        basis = "mean" if row["config"] == "interval" else "median"
        row["ratio"] = round(row[f"step_ms_{basis}"] / ref[f"step_ms_{basis}"], 4)
        row["ratio_basis"] = basis
        # Fastest block against fastest block: the least load-disturbed comparison (shown
        # beside the median ratio; the targets use the median).
        row["ratio_of_min"] = round(row["step_ms_min"] / ref["step_ms_min"], 4)


def _apply_targets(rows: list[dict[str, Any]]) -> list[tuple[Target, dict[str, Any], str, str]]:
    """Check each target against the ``ti`` rows; returns (target, row, value text, status)."""
    checks = []
    bare = {(r["workload"], r["device"]): r for r in rows if r["config"] == "bare"}
    for row in rows:
        if row["impl"] not in ("ti", "-") or row["config"] == "bare":
            continue
        texts, statuses = [], []
        for target in TARGETS:
            if (target.workload, target.config) != (row["workload"], row["config"]):
                continue
            if row.get("sink") == "memory" or (row["device"] != "cpu" and target.unit != "x"):
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


def _fmt(value: Any, spec: str = "") -> str:
    if value in (None, ""):
        return "-"
    return format(value, spec) if spec else str(value)


def _print_table(rows: list[dict[str, Any]], checks: list[Any], baseline_ratios: bool) -> None:
    header = (
        f"{'workload':<12}{'impl':<10}{'config':<14}{'sink':<7}{'median ms':>11}{'ratio':>9}"
        f"{'min-ratio':>10}"
        f"{'removal s':>11}{'peak RSS MB':>13}{'rows':>10}  note"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = _fmt(r.get("ratio"), ".3f")
        if r.get("ratio_basis") == "mean":
            ratio += "m"
        note = r.get("error") or ""
        if r.get("exact_quartiles") not in (None, ""):
            note += f"exact quartiles: {r['exact_quartiles']} "
        if r.get("syncs_per_step") not in (None, ""):
            note += f"syncs/step: {r['syncs_per_step']} dev MB: {r.get('peak_device_mb')} "
        if r["workload"] == "history":
            note += f"RSS growth {r.get('rss_growth_mb')} MB"
        print(
            f"{r['workload']:<12}{r['impl']:<10}{r['config']:<14}{r['sink']:<7}"
            f"{_fmt(r.get('step_ms_median'), '.3f'):>11}{ratio:>9}"
            f"{_fmt(r.get('ratio_of_min'), '.3f'):>10}"
            f"{_fmt(r.get('removal_s'), '.3f'):>11}{_fmt(r.get('peak_rss_mb'), '.0f'):>13}"
            f"{_fmt(r.get('history_rows')):>10}  {note[:60]}"
        )
    print(
        "(ratio: of medians of per-block step times, 'm': of means, the amortized interval cost;"
        " min-ratio: fastest block vs fastest bare block, the least load-disturbed view)\n"
    )
    print("Targets (issue 7)")
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
        print(f"  {row['workload']:<10}{target.describe():<{width}}{shown:>16}   {status}{other}")


def _specs(args: argparse.Namespace, baseline: bool) -> list[dict[str, Any]]:
    specs: list[dict[str, Any]] = []
    for workload in args.workloads:
        if workload == "history":
            rows = args.history_rows or (HISTORY_ROWS_QUICK if args.quick else HISTORY_ROWS)
            specs.append(
                {
                    "workload": "history",
                    "config": "finalize",
                    "label": "finalize",
                    "impl": "ti",
                    "sink": "dir",
                    "rows": rows,
                    "device": "cpu",
                }
            )
            continue
        plan = _plan(args, workload)
        impls = ["ti", *([BASELINE] if baseline else [])]
        for config in args.configs:
            for impl in impls if config != "bare" else ["ti"]:
                if config == "every-memory" and impl == BASELINE:
                    continue  # 0.8.0 has no MemorySink
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
    return specs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated subset of {','.join(WORKLOADS)}",
    )
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated subset of {','.join(CONFIGS)}",
    )
    parser.add_argument("--repeats", type=int, help="timed blocks per configuration")
    parser.add_argument("--steps", type=int, help="steps per timed block")
    parser.add_argument("--every-steps", type=int, help="steps per block when sampling every one")
    parser.add_argument("--interval-steps", type=int, help="steps of the 60-s interval config")
    parser.add_argument("--warmup", type=int, help="untimed steps before timing")
    parser.add_argument("--history-rows", type=int, help="rows of the history workload")
    parser.add_argument("--quick", action="store_true", help="tiny plan: a smoke run")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (synchronized timings)")
    parser.add_argument("--output", type=Path, help="CSV path (default benchmarks/results/)")
    parser.add_argument(
        "--baseline-python",
        default=sys.executable,
        help="interpreter that can import torchinstruments 0.8.0",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip torchinstruments")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.configs = [c for c in args.configs.split(",") if c]
    for name in args.workloads:
        if name not in WORKLOADS:
            parser.error(f"--workloads: unknown {name!r}; choose from {','.join(WORKLOADS)}")
    for name in args.configs:
        if name not in CONFIGS:
            parser.error(f"--configs: unknown {name!r}; choose from {','.join(CONFIGS)}")
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
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for spec in _specs(args, baseline):
        python = args.baseline_python if spec.get("impl") == BASELINE else sys.executable
        label = f"{spec['workload']}/{spec['config']}/{spec.get('impl')}/{spec.get('sink')}"
        print(f"  running {label} ...", end="", flush=True)
        t0 = time.perf_counter()
        got = _run_worker(python, spec, args.timeout)
        error = f"  ERROR {got['error']}" if "error" in got else ""
        print(f" {time.perf_counter() - t0:.1f} s{error}")
        rows.append(_row(run_id, spec, got))
    _apply_ratios(rows)
    checks = _apply_targets(rows)
    print()
    _print_table(rows, checks, baseline)
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
