"""A pass over a large array split between the calling thread and a helper thread.

Tensors too large to snapshot are reduced on the training thread; their pass may use a second
core (``numpy_rows.in_halves``) where torch itself may use more than one. The split must not
change a bit: per-block sums are added in block order whichever thread computed them, counts
and order statistics are exact. The size from which the pass splits is lowered here so the
arrays stay small.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from _core_helpers import reference

from ti_core.reduction import numpy_histograms, numpy_rows
from ti_core.reduction.numpy_rows import BLOCK


@pytest.fixture(autouse=True)
def _split_small_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numpy_rows, "PARALLEL_MIN", 2 * BLOCK)


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(16)
    n = 5 * BLOCK + 12_345  # an odd number of blocks, the last one partial
    normal = rng.standard_normal(n).astype(np.float32)
    mixed = normal.copy()
    mixed[rng.random(n) < 0.01] = np.nan
    mixed[rng.random(n) < 0.005] = np.inf
    mixed[rng.random(n) < 0.005] = -np.inf
    relu = np.maximum(normal, 0)  # ties at zero: the tied bands
    signed_zeros = np.abs(normal) + 1
    signed_zeros[: 3 * BLOCK] = 0.0  # the minimum is +0.0 in the first half...
    signed_zeros[3 * BLOCK + 7] = -0.0  # ...and -0.0 in the second: the first one wins
    skewed = np.concatenate([np.full(n - 1000, 1e4), rng.standard_normal(1000)]).astype(
        np.float64
    )  # the sample misplaces the shift: the second, centred pass runs
    return {
        "normal": normal,
        "mixed": mixed,
        "relu": relu,
        "signed_zeros": signed_zeros,
        "skewed": skewed,
        "float64": rng.standard_normal(n) * 3 + 1,
    }


def test_in_halves_runs_the_first_half_on_a_helper_thread() -> None:
    seen: list[tuple[int, int, str]] = []

    def run(start: int, stop: int) -> tuple[int, int]:
        seen.append((start, stop, threading.current_thread().name))
        return start, stop

    n = 5 * BLOCK + 1
    assert numpy_rows.in_halves(n, run, parallel=True) == [(0, 3 * BLOCK), (3 * BLOCK, n)]
    names = {name for _, _, name in seen}
    assert threading.current_thread().name in names
    assert "ti-core reduction" in names
    assert numpy_rows.in_halves(n, run, parallel=False) == [(0, n)]
    assert numpy_rows.in_halves(BLOCK, run, parallel=True) == [(0, BLOCK)]  # below the size


def test_in_halves_raises_the_helpers_failure_on_the_calling_thread() -> None:
    def run(start: int, stop: int) -> int:
        if start == 0:
            raise ValueError("helper half failed")
        return stop

    with pytest.raises(ValueError, match="helper half failed"):
        numpy_rows.in_halves(5 * BLOCK, run, parallel=True)


@pytest.mark.parametrize("name", sorted(_arrays()))
def test_split_pass_is_bit_identical_and_exact(name: str) -> None:
    a = _arrays()[name]
    row, moments = numpy_rows.reduce_large(a)
    split_row, split_moments = numpy_rows.reduce_large(a, parallel=True)
    assert row.tobytes() == split_row.tobytes()
    assert moments == split_moments
    if moments.finite:
        assert math.copysign(1.0, moments.lo) == math.copysign(1.0, split_moments.lo)
    hist = numpy_histograms.histogram_large(a, 30, moments, trusted=True)
    split_hist = numpy_histograms.histogram_large(a, 30, moments, trusted=True, parallel=True)
    assert hist.tobytes() == split_hist.tobytes()

    finite = a[np.isfinite(a)].astype(np.float64)
    assert list(row[[4, 5, 6]]) == list(np.percentile(finite, [25, 50, 75]))
    edges = np.linspace(finite.min(), finite.max(), 31)
    if finite.min() < finite.max():
        counts, _ = np.histogram(finite, bins=edges)
        assert list(split_hist[-30:]) == counts.tolist()


# Run in a fresh process: once torch has run a parallel region on two threads, a later fork
# (test_emission's forked child) may hang in the OpenMP pool it inherits.
_PROBE = """
import json, sys, threading
import numpy as np, torch
from ti_core import AlwaysSampler, MemorySink, inject_observer, observer_of, remove_observer
from ti_core.reduction import placement
from ti_core.reduction import numpy_rows

a = np.load(sys.argv[1])
placement.SNAPSHOT_BUDGET_BYTES = numpy_rows.BLOCK  # reduced on the capturing thread
numpy_rows.PARALLEL_MIN = 2 * numpy_rows.BLOCK
scan_blocks = numpy_rows._scan_blocks
names = set()

def spy(*args):
    names.add(threading.current_thread().name)
    return scan_blocks(*args)

numpy_rows._scan_blocks = spy

class Emit(torch.nn.Module):
    def forward(self, x):
        return torch.from_numpy(a)

out = {}
for threads in (1, 2):
    names.clear()
    torch.set_num_threads(threads)
    model, sink = Emit(), MemorySink()
    inject_observer(
        model, output_dir=None, sink=sink, sampler=AlwaysSampler(), error_policy="raise"
    )
    model(torch.zeros(1))
    observer_of(model).drain()
    remove_observer(model)
    fields = ("bucket_limits", "bucket_counts", "min", "max", "sum", "sum_squares", "num")
    out[threads] = {
        "history": sorted(
            [r["metric"], r["value"], r["unavailable_reason"]] for r in sink.table().to_pylist()
        ),
        "histograms": [[r[k] for k in fields] for r in sink.histograms().to_pylist()],
        "threads": sorted(names),
        "main": threading.current_thread().name,
    }
print(json.dumps(out))
"""


def test_capture_splits_only_where_torch_may_use_two_threads(tmp_path: Path) -> None:
    a = _arrays()["mixed"]
    np.save(tmp_path / "a.npy", a)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tmp_path / "a.npy")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    one, two = got["1"], got["2"]
    assert one["threads"] == [one["main"]]
    assert two["threads"] == sorted([two["main"], "ti-core reduction"])
    assert one["history"] == two["history"]  # bit for bit (floats round-trip through JSON)
    assert one["histograms"] == two["histograms"]
    assert len(one["histograms"]) == 1
    want = reference(a)
    values = {metric: value for metric, value, _ in one["history"]}
    for metric in ("min", "max", "p25", "p50", "p75", "zero_fraction", "nonfinite_fraction"):
        assert values[metric] == want[metric], metric
