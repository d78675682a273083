"""Outputs-only vs all five signals, and wandb.watch on the same training step.

For each workload (``sequence``, ``transformer`` from ``workloads.py``: model and input) the
step is a full training step: ``zero_grad(set_to_none=True)``, forward, backward of
``model(x).pow(2).mean()`` (``x`` detached), and ``SGD(lr=0.01, momentum=0.9).step()``
(``parameter_update`` needs the optimizer step; the weights stay finite). One
process alternates short blocks of each configuration with bare blocks, so every ratio is taken
against a bare block measured next to it (the machine is shared; see README.md, "Rounds"):

- ``unsampled``: attached with ``EveryNForwardsSampler(10**9)``, outputs only (the default
  ``signals``) and all five signals; the one sampled forward after each attach is not timed.
- ``sampled``: attached with ``AlwaysSampler()`` (every step sampled and written with the
  directory sink), outputs only, all five signals, and ``parameters`` (``parameter`` and
  ``parameter_gradient``: what wandb.watch(log="all") records).
- ``wandb.watch``: ``wandb.init(mode="offline")``, ``wandb.watch(model, log="all",
  log_freq=1)`` and one ``run.log`` per step (watch's histograms are sent with the next log);
  and ``log_freq=10**9`` without ``run.log``: the cost of its hooks between logs. Measured if
  ``wandb`` imports; otherwise the reason is printed.

Data per sample: the bytes of ``history.parquet`` + ``histograms.parquet`` of a run sampling
every step, divided by the samples, and its rows per sample; for wandb.watch, the bytes of the
offline run directory divided by the logged steps.

    python benchmarks/parameter_signals.py [--workloads sequence,transformer] [--pairs 7]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("WANDB_SILENT", "true")

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads

OUTPUTS = ("output", "output_gradient")
PARAMETERS = ("parameter", "parameter_gradient")
ALL_FIVE = (*OUTPUTS, *PARAMETERS, "parameter_update")
SIGNALS = {"outputs": OUTPUTS, "all five": ALL_FIVE, "parameters": PARAMETERS}
"""``parameters``: what wandb.watch(log="all") records (values and gradients), no outputs."""
CONFIGS = (
    "unsampled outputs",
    "unsampled all five",
    "sampled outputs",
    "sampled all five",
    "sampled parameters",
)


def _block(step: Callable[[], None], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def _dir_bytes(path: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in path.rglob(pattern) if p.is_file())


@contextmanager
def _observed(model: torch.nn.Module, out: Path, *, sampled: bool, signals: str) -> Iterator[None]:
    from ti_core import AlwaysSampler, EveryNForwardsSampler, inject_observer, remove_observer

    sampler = AlwaysSampler() if sampled else EveryNForwardsSampler(10**9)
    inject_observer(model, output_dir=out, sampler=sampler, signals=SIGNALS[signals])
    try:
        yield
    finally:
        remove_observer(model)


def training_step(name: str) -> tuple[torch.nn.Module, Callable[[], None]]:
    """The workload's model and input (seeded, deterministic; the input detached, as when the
    figures in benchmarks/README.md were taken) in a full training step with the loss
    ``model(x).pow(2).mean()`` and an optimizer step after it."""
    w = workloads.build(name)
    inputs: list[torch.Tensor] = []
    handle = w.model.register_forward_pre_hook(lambda _m, args: inputs.append(args[0]))
    try:
        w.step()  # only to pick up the workload's input
    finally:
        handle.remove()
    model, x = w.model, inputs[0].detach()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        optimizer.step()

    return model, step


def time_configs(name: str, pairs: int, steps: int, sampled_steps: int) -> dict[str, list[float]]:
    """Per configuration: the ratios of its blocks to the adjacent bare block's."""
    model, step = training_step(name)
    for _ in range(workloads.DEFAULTS[name].warmup):
        step()
    ratios: dict[str, list[float]] = {c: [] for c in (*CONFIGS, "bare ms")}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            order = CONFIGS if i % 2 == 0 else tuple(reversed(CONFIGS))
            for config in order:
                mode, signals = config.split(" ", 1)
                sampled = mode == "sampled"
                n = sampled_steps if sampled else steps
                bare = _block(step, n)
                out = Path(tmp) / f"{config.replace(' ', '-')}-{i}"
                with _observed(model, out, sampled=sampled, signals=signals):
                    if not sampled:
                        step()  # forward 0 is always sampled: not timed
                        step()
                    attached = _block(step, n)
                ratios[config].append(attached / bare)
                ratios["bare ms"].append(bare * 1e3)
    return ratios


def data_per_sample(name: str, samples: int) -> dict[str, tuple[float, float]]:
    """Bytes and rows per sample of a run sampling every step, per signal set."""
    import polars as pl

    result = {}
    for label in SIGNALS:
        model, step = training_step(name)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run"
            with _observed(model, out, sampled=True, signals=label):
                for _ in range(samples):
                    step()
            size = (out / "history.parquet").stat().st_size
            size += (out / "histograms.parquet").stat().st_size
            rows = pl.read_parquet(out / "history.parquet").height
        result[label] = (size / samples, rows / samples)
    return result


def wandb_watch(
    name: str, pairs: int, steps: int, unsampled_steps: int
) -> tuple[list[float], list[float], float] | str:
    """Ratios of watched blocks to adjacent bare ones, logging every step (``log_freq=1``, one
    ``run.log`` per step) and not logging (``log_freq=10**9``: the hooks' cost between logs),
    and the offline bytes per logged step; or the reason wandb.watch could not be measured."""
    try:
        import wandb
    except ImportError as exc:
        return f"wandb does not import ({exc}); pip install wandb to measure it"
    model, step = training_step(name)
    for _ in range(workloads.DEFAULTS[name].warmup):
        step()
    ratios = []
    quiet = []
    logged = 0
    with tempfile.TemporaryDirectory() as tmp:
        try:
            run: Any = wandb.init(
                mode="offline", dir=tmp, project="ti-bench", settings=wandb.Settings(quiet=True)
            )
        except Exception as exc:  # any failure of wandb's own start is the reason
            return f"wandb.init(mode='offline') failed: {type(exc).__name__}: {exc}"

        def watched() -> None:
            nonlocal logged
            step()
            run.log({"step": logged})
            logged += 1

        try:
            run.watch(model, log="all", log_freq=1)
            watched()  # the first log creates the histogram keys: not timed
            for _ in range(pairs):
                bare = _block(step, steps)
                ratios.append(_block(watched, steps) / bare)
            run.unwatch(model)
            run.watch(model, log="all", log_freq=10**9)
            step()
            for _ in range(pairs):
                bare = _block(step, unsampled_steps)
                quiet.append(_block(step, unsampled_steps) / bare)
            run.unwatch(model)
        finally:
            run.finish()
        size = _dir_bytes(Path(tmp), "*.wandb")
    return ratios, quiet, size / logged


def _row(label: str, ratio: float, bare_ms: float, q1: float, q3: float) -> None:
    print(f"  {label:28s} {ratio * bare_ms:8.3f} ms  {ratio:6.3f}x  (q1-q3 {q1:.3f}-{q3:.3f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="sequence,transformer")
    parser.add_argument("--pairs", type=int, default=7, help="blocks per configuration")
    parser.add_argument("--steps", type=int, default=30, help="steps per unsampled block")
    parser.add_argument("--sampled-steps", type=int, default=5, help="steps per sampled block")
    parser.add_argument("--samples", type=int, default=10, help="samples for the data size")
    parser.add_argument("--no-wandb", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread; ratio = median over {args.pairs} blocks of")
    print("(configuration block / adjacent bare block); q1-q3 the quartiles of those ratios")
    for name in args.workloads.split(","):
        print(f"\n{name}: {workloads.DESCRIPTIONS[name]} + SGD(momentum=0.9) step")
        print("  (loss model(x).pow(2).mean(), input detached)")
        ratios = time_configs(name, args.pairs, args.steps, args.sampled_steps)
        bare_ms = statistics.median(ratios.pop("bare ms"))
        print(f"  {'bare step':28s} {bare_ms:8.3f} ms")
        for config, values in ratios.items():
            values.sort()
            ratio = statistics.median(values)
            q1, q3 = values[len(values) // 4], values[3 * len(values) // 4]
            _row(config, ratio, bare_ms, q1, q3)
        for label, (size, rows) in data_per_sample(name, args.samples).items():
            print(f"  data per sample, {label:10s} {size / 1024:8.1f} KiB, {rows:.0f} history rows")
        if args.no_wandb:
            continue
        watch = wandb_watch(name, args.pairs, args.sampled_steps, args.steps)
        if isinstance(watch, str):
            print(f"  wandb.watch(log='all'): not measured: {watch}")
            continue
        logging, quiet, size = watch
        for label, values in (
            ("wandb.watch unsampled", quiet),
            ("wandb.watch log=all freq=1", logging),
        ):
            values.sort()
            ratio = statistics.median(values)
            q1, q3 = values[len(values) // 4], values[3 * len(values) // 4]
            _row(label, ratio, bare_ms, q1, q3)
        print(f"  data per step, wandb offline  {size / 1024:8.1f} KiB (.wandb file)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
