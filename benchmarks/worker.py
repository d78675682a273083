"""Measure one benchmark configuration in this (fresh) process; print one JSON line.

Run by ``benchmarks/run.py`` as ``python benchmarks/worker.py '<json spec>'``, one process per
configuration so no allocator, hook, thread or import state leaks from one measurement into the
next. Spec keys: workload, config (bare | unsampled | every | interval), impl (ti | ti-ref |
ti-0.8.0), sink (dir | memory), device, warmup, steps, repeats, interval_steps.
"""

from __future__ import annotations

import inspect
import os

# One intra-op thread, as in the reference measurements; set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import json
import resource
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads

QUARTILES = {"p25": 0.25, "p50": 0.5, "p75": 0.75}


BASELINE, REFERENCE = workloads.BASELINE, workloads.REFERENCE

PRECISION3 = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
"""The formats of the ``precision3`` configuration: ``every`` with the precision profile."""


class _Impl:
    """The observer implementation under test: this monorepo's ti_core, or torchinstruments."""

    def __init__(self, impl: str) -> None:
        self.name = impl
        if impl in ("ti", REFERENCE):
            import ti_core

            self.mod: Any = ti_core
        elif impl == BASELINE:
            import torchinstruments

            self.mod = torchinstruments
        else:
            raise ValueError(f"unknown impl {impl!r}")

    def inject(self, model: torch.nn.Module, config: str, sink: str, out: Path) -> Any:
        mod = self.mod
        kwargs: dict[str, Any] = {}
        if config in ("unsampled", "sentinel"):
            # The first forward is always sampled; the warmup runs past it.
            kwargs["sampler"] = mod.EveryNForwardsSampler(10**9)
        if "sentinel" in inspect.signature(mod.inject_observer).parameters:
            # ``sentinel``: the flight recorder as ti-core's default has it (replay mode); the
            # other configurations measure the observer's sampling without it
            kwargs["sentinel"] = config == "sentinel"
        if config in ("every", "precision3"):
            kwargs["sampler"] = mod.AlwaysSampler()
        if config == "precision3":
            kwargs["precision"] = PRECISION3
        memory = None
        if sink == "memory":
            memory = mod.MemorySink()
            kwargs["sink"] = memory
            kwargs["output_dir"] = None  # in memory only (ti-core's MemorySink)
        else:
            kwargs["output_dir"] = str(out)
        mod.inject_observer(model, **kwargs)
        return memory

    def remove(self, model: torch.nn.Module) -> None:
        self.mod.remove_observer(model)

    def settle(self, model: torch.nn.Module) -> None:
        """Wait until the work of the steps run so far is done: ti-core reduces and writes
        sampled signals on its emission worker, which must not be left out of a timed block
        (nor leak into the next one). torchinstruments 0.8.0 works inline: nothing to wait for.
        """
        if self.name == BASELINE:
            return
        observer_of = getattr(self.mod, "observer_of", None)
        if observer_of is not None:
            observer = observer_of(model)
        else:  # a --reference-python tree older than ti_core.observer_of
            from ti_core.observer import ATTRIBUTE

            observer = model.__dict__.get(ATTRIBUTE)
        if observer is not None:
            observer.drain()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_blocks(
    step: Any, device: str, steps: int, repeats: int, settle: Any = None
) -> list[float]:
    """Seconds per step of each of ``repeats`` blocks of ``steps`` steps; ``settle()`` (waiting
    for the observer's background work of those steps) is inside each block's time."""
    per_step = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if settle is not None:
            settle()
        _sync(device)
        per_step.append((time.perf_counter() - start) / steps)
    return per_step


def _count_syncs(step: Any) -> int:
    """Host synchronizations one step triggers (CUDA sync debug mode warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def _history_rows(out: Path, memory: Any) -> tuple[int | None, Any]:
    import pyarrow.parquet as pq

    if memory is not None:
        table = memory.table()
        return table.num_rows, table
    files = sorted(out.rglob("history.parquet"))
    if not files:
        return None, None
    table = pq.read_table(files[0])
    return table.num_rows, table


def _check_quartiles(table: Any, x: torch.Tensor) -> tuple[bool | None, float | None]:
    """Compare the last sample's output p25/p50/p75 with numpy float64 linear quantiles."""
    import numpy as np
    import pyarrow.compute as pc

    if table is None or "metric" not in table.column_names:
        return None, None
    last = pc.max(table["forward_index"]).as_py()
    rows = table.filter(
        pc.and_(pc.equal(table["forward_index"], last), pc.equal(table["signal"], "output"))
    ).to_pylist()
    found = {r["metric"]: r["value"] for r in rows if r["metric"] in QUARTILES}
    if set(found) != set(QUARTILES) or any(v is None for v in found.values()):
        return False, None
    expected = np.quantile(x.detach().cpu().double().numpy(), list(QUARTILES.values()))
    errors = [abs(found[k] - e) for k, e in zip(QUARTILES, expected, strict=True)]
    worst = max(errors)
    exact = all(err <= 1e-6 * max(1.0, abs(e)) for err, e in zip(errors, expected, strict=True))
    return exact, worst


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration and return its measurements."""
    torch.set_num_threads(1)
    device = spec.get("device", "cpu")
    config = spec["config"]
    work = workloads.build(spec["workload"], device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    process = psutil.Process()
    result: dict[str, Any] = {}
    impl = None if config == "bare" else _Impl(spec["impl"])
    with tempfile.TemporaryDirectory(prefix="ti-bench-") as tmp:
        out = Path(tmp) / "stats"
        memory = None
        for _ in range(spec["warmup"] if config == "interval" else 0):
            work.step()  # the interval run warms the model bare, then times its first sample too
        result["baseline_rss_mb"] = process.memory_info().rss / 2**20
        if impl is not None:
            start = time.perf_counter()
            memory = impl.inject(work.model, config, spec.get("sink", "dir"), out)
            result["inject_s"] = time.perf_counter() - start
        settle = None if impl is None else (lambda: impl.settle(work.model))
        if config == "interval":
            total = spec["interval_steps"]
            blocks = max(1, min(spec["repeats"], total))
            per_block = total // blocks
            times = _time_blocks(work.step, device, per_block, blocks, settle)
            result["steps_timed"] = per_block * blocks
        else:
            for _ in range(spec["warmup"]):
                work.step()
            if settle is not None:
                settle()  # the warmup's sampled forwards are not part of the timed blocks
            steps = spec["every_steps"] if config in ("every", "precision3") else spec["steps"]
            times = _time_blocks(work.step, device, steps, spec["repeats"], settle)
            result["steps_timed"] = steps * spec["repeats"]
        result["step_s_median"] = statistics.median(times)
        result["step_s_mean"] = statistics.fmean(times)
        result["step_s_min"] = min(times)
        result["step_s_all"] = times
        if device.startswith("cuda"):
            result["peak_device_mb"] = torch.cuda.max_memory_allocated() / 2**20
            result["syncs_per_step"] = _count_syncs(work.step)
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if impl is not None:
            start = time.perf_counter()
            impl.remove(work.model)
            result["removal_s"] = time.perf_counter() - start
            rows, table = _history_rows(out, memory)
            result["history_rows"] = rows
            if work.last_input is not None and config == "every":
                exact, err = _check_quartiles(table, work.last_input())
                result["exact_quartiles"] = exact
                result["quartile_abs_err"] = err
            del table
        result["peak_rss_after_removal_mb"] = (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        )
    result["tensor_mb"] = work.tensor_bytes / 2**20
    result["torch_threads"] = torch.get_num_threads()
    return result


def measure_history(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``history`` workload: ti-io's finalization benchmark (benchmarks/history_finalize.py)."""
    import history_finalize

    got = history_finalize.run(rows=spec["rows"])
    return {
        "finalize_s": got["finalize_s"],
        "removal_s": got["finalize_s"],
        "rss_growth_mb": got["peak_rss_growth_mb"],
        "history_rows": got["rows"],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "extra": {k: v for k, v in got.items() if k not in {"workload", "rows"}},
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        result = measure_history(spec) if spec["workload"] == "history" else measure(spec)
    except Exception as error:  # reported in the table, not a crash of the whole run
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
