"""A pass over a large array split between the calling thread and a helper thread.

Tensors too large to snapshot are reduced on the training thread; their pass may use a second
core (``numpy_rows.in_halves``) where torch itself may use more than one. The split must not
change a bit: per-block sums are added in block order whichever thread computed them, counts
and order statistics are exact. The size from which the pass splits is lowered here so the
arrays stay small.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import pytest
import torch
from _core_helpers import reference

from ti_core import AlwaysSampler, MemorySink, inject_observer, observer_of, remove_observer
from ti_core.capture import batch
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


class _Emit(torch.nn.Module):
    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self.tensor = tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tensor


def _observed_rows(tensor: torch.Tensor, threads: int) -> tuple[list[Any], list[Any], set[str]]:
    """One sample of ``tensor`` (too large to snapshot) under ``torch.set_num_threads``:
    history and histogram rows, and the names of the threads that scanned it."""
    names: set[str] = set()
    scan_blocks = numpy_rows._scan_blocks

    def spy(*args: Any) -> Any:
        names.add(threading.current_thread().name)
        return scan_blocks(*args)

    model = _Emit(tensor)
    sink = MemorySink()
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(numpy_rows, "_scan_blocks", spy)
        torch.set_num_threads(threads)
        inject_observer(
            model, output_dir=None, sink=sink, sampler=AlwaysSampler(), error_policy="raise"
        )
        try:
            observer = observer_of(model)
            assert observer is not None
            model(torch.zeros(1))
            observer.drain()
        finally:
            remove_observer(model)
            torch.set_num_threads(before)
    history = sorted(
        (r["metric"], r["value"], r["unavailable_reason"]) for r in sink.table().to_pylist()
    )
    fields = ("bucket_limits", "bucket_counts", "min", "max", "sum", "sum_squares", "num")
    histograms = [[r[k] for k in fields] for r in sink.histograms().to_pylist()]
    return history, histograms, names


def test_capture_splits_only_where_torch_may_use_two_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(batch, "SNAPSHOT_BUDGET_BYTES", BLOCK)  # reduced on the capturing thread
    a = _arrays()["mixed"]
    one = _observed_rows(torch.from_numpy(a), threads=1)
    two = _observed_rows(torch.from_numpy(a), threads=2)
    assert one[2] == {threading.current_thread().name}
    assert two[2] == {threading.current_thread().name, "ti-core reduction"}
    assert one[0] == two[0]  # bit for bit
    assert one[1] == two[1]
    want = reference(a)
    assert len(one[1]) == 1
    got = {metric: value for metric, value, _ in one[0]}
    for metric in ("min", "max", "p25", "p50", "p75", "zero_fraction", "nonfinite_fraction"):
        assert got[metric] == want[metric], metric
