"""Leak soak: many sampled steps, some forwards never backwarded; memory must stay flat.

Runs ``--steps`` root forwards of a small MLP with every forward sampled (AlwaysSampler). A
third of them never get a backward (their graph, and the gradient capture bound to it, is just
dropped, as in an evaluation or a skipped batch) and some run under ``torch.no_grad()``. At
intervals it reports RSS and the live ``torch.Tensor`` count (gc-tracked objects). After a
warm-up tenth of the run both must stay flat: RSS within ``--rss-tolerance-mb`` and the tensor
count within ``--tensor-tolerance``. Exit status 0 = flat (pass), 1 = growth (fail).

The default sink discards batches after counting rows, so sink buffering is not mistaken for an
observer leak; ``--sink dir`` soaks the real directory sink (its writer is bounded too), and
``--sink memory`` is expected to grow (MemorySink keeps every row by design).

    python benchmarks/soak.py                # 20,000 steps
    python benchmarks/soak.py --steps 2000   # quick
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import torch
from torch import nn


class CountingSink:
    """A Sink that counts rows and keeps nothing (isolates the observer from sink buffering)."""

    def __init__(self) -> None:
        self.history_rows = 0
        self.histogram_rows = 0

    def open(self, run: Any) -> None:
        pass

    def write_history(self, batch: pa.RecordBatch) -> None:
        self.history_rows += batch.num_rows

    def write_histograms(self, batch: pa.RecordBatch) -> None:
        self.histogram_rows += batch.num_rows

    def close(self) -> None:
        pass


def live_tensors() -> int:
    """gc-tracked ``torch.Tensor`` objects (parameters included; constant for a fixed model)."""
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--report-every", type=int, default=0, help="default: steps / 20")
    parser.add_argument("--sink", choices=("count", "dir", "memory"), default="count")
    parser.add_argument("--rss-tolerance-mb", type=float, default=16.0)
    parser.add_argument("--tensor-tolerance", type=int, default=8)
    parser.add_argument("--json", type=Path, help="also write the series here")
    args = parser.parse_args(argv)
    from ti_core import AlwaysSampler, MemorySink, inject_observer, remove_observer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(16, 32)
    every = args.report_every or max(1, args.steps // 20)
    process = psutil.Process()
    series: list[dict[str, float]] = []
    counting = CountingSink()
    with tempfile.TemporaryDirectory(prefix="ti-soak-") as tmp:
        options: dict[str, Any] = {"sampler": AlwaysSampler()}
        if args.sink == "dir":
            options["output_dir"] = str(Path(tmp) / "stats")
        elif args.sink == "memory":
            options.update(sink=MemorySink(), output_dir=None)
        else:
            options.update(sink=counting, output_dir=None)
        inject_observer(model, **options)
        start = time.perf_counter()
        try:
            for step in range(1, args.steps + 1):
                kind = step % 6
                if kind in (1, 4):
                    model(x)  # a forward whose graph is dropped: no backward ever comes
                elif kind == 5:
                    with torch.no_grad():
                        model(x)
                else:
                    opt.zero_grad(set_to_none=True)
                    model(x).square().mean().backward()
                    opt.step()
                if step % every == 0 or step == args.steps:
                    point = {
                        "step": step,
                        "seconds": round(time.perf_counter() - start, 2),
                        "rss_mb": round(process.memory_info().rss / 2**20, 2),
                        "live_tensors": live_tensors(),
                        "history_rows": counting.history_rows,
                    }
                    series.append(point)
                    print(json.dumps(point), flush=True)
        finally:
            remove_observer(model)
    settled = [p for p in series if p["step"] > args.steps // 10] or series
    first, last = settled[0], settled[-1]
    rss_growth = last["rss_mb"] - first["rss_mb"]
    tensor_growth = last["live_tensors"] - first["live_tensors"]
    flat = rss_growth <= args.rss_tolerance_mb and tensor_growth <= args.tensor_tolerance
    verdict = {
        "steps": args.steps,
        "sink": args.sink,
        "rss_growth_mb": round(rss_growth, 2),
        "tensor_growth": tensor_growth,
        "rss_tolerance_mb": args.rss_tolerance_mb,
        "tensor_tolerance": args.tensor_tolerance,
        "result": "PASS (flat)" if flat else "FAIL (growth)",
    }
    print(json.dumps(verdict))
    if args.json:
        args.json.write_text(json.dumps({"series": series, "verdict": verdict}, indent=2))
    return 0 if flat or args.sink == "memory" else 1


if __name__ == "__main__":
    sys.exit(main())
