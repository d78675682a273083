"""DirectorySink fed by the observer's emission worker: flush and exit flush include every
signal that ended before them (real models and training steps, no sleeps, no timings)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from ti_core import AlwaysSampler, inject_observer, observer_of, remove_observer
from ti_core.observer import Observer
from ti_core.reduction import placement
from ti_core.sink import RunInfo
from ti_io import DirectorySink, TensorBoardSink, scan_history

SIGNALS = ("output", "output_gradient")
DEADLINE_S = 60.0
"""Upper bound for a wait that a correct implementation ends at once (a hang guard only)."""


@pytest.fixture(autouse=True)
def _every_signal_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about writes from the emission worker: their small signals go to it
    too, instead of being written at once while it is idle."""
    monkeypatch.setattr(placement, "INLINE_SIGNAL_BYTES", -1)


def make_model() -> nn.Sequential:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)) for _ in range(steps)]


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def attached(model: nn.Module) -> Observer:
    observer = observer_of(model)
    assert observer is not None
    return observer


def per_signal_rows(run: RunInfo) -> int:
    return len(run.layers) * len(run.metrics)


def assert_samples(frame: pl.DataFrame, samples: int, run: RunInfo) -> None:
    """Every sample 0..samples-1 has its full rows for both signals, and nothing else."""
    counts = frame.group_by("signal", "sample_id").len().sort("signal", "sample_id")
    expected = pl.DataFrame(
        {
            "signal": [s for s in SIGNALS for _ in range(samples)],
            "sample_id": [i for _ in SIGNALS for i in range(samples)],
            "len": [per_signal_rows(run)] * (len(SIGNALS) * samples),
        },
        schema=counts.schema,
    )
    assert counts.equals(expected), counts


class GatedDirectorySink(DirectorySink):
    """Its writes wait until a reader passes the observer's barrier, so a flush that skipped
    the barrier would publish without the step's rows, whatever the scheduling."""

    def __init__(self, output_dir: Path) -> None:
        super().__init__(output_dir)
        self.gate = threading.Event()

    def attach_barrier(self, barrier: Callable[[], None]) -> None:
        def opening() -> None:
            self.gate.set()
            barrier()

        super().attach_barrier(opening)

    def _pass(self) -> None:
        if not self.gate.wait(DEADLINE_S):
            raise TimeoutError("no flush passed the barrier")

    def write_history(self, batch: pa.RecordBatch) -> None:
        self._pass()
        super().write_history(batch)

    def write_histograms(self, batch: pa.RecordBatch) -> None:
        self._pass()
        super().write_histograms(batch)


class RecordingDirectorySink(DirectorySink):
    """Notes, at each write, the writing thread and the observer's ``emission_thread``."""

    def __init__(self, output_dir: Path) -> None:
        super().__init__(output_dir)
        self.observer: Observer | None = None
        self.writers: list[tuple[threading.Thread, threading.Thread | None]] = []

    def _note(self) -> None:
        emission = self.observer.emission_thread if self.observer is not None else None
        self.writers.append((threading.current_thread(), emission))

    def write_history(self, batch: pa.RecordBatch) -> None:
        self._note()
        super().write_history(batch)

    def write_histograms(self, batch: pa.RecordBatch) -> None:
        self._note()
        super().write_histograms(batch)


def test_flush_publishes_every_step_written_by_the_worker(tmp_path: Path) -> None:
    steps = 6
    out = tmp_path / "stats"
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sink = RecordingDirectorySink(out)  # default buffer_rows: nothing published before flush
    inject_observer(model, sink=sink, sampler=AlwaysSampler())
    observer = attached(model)
    sink.observer = observer
    try:
        for x, y in batches(steps):
            train_step(model, optimizer, x, y)
        sink.flush()
        assert_samples(scan_history(out).collect(), steps, observer.run)
    finally:
        remove_observer(model)
    assert sink.writers
    for current, emission in sink.writers:  # every write ran on the observer's worker
        assert current is emission
        assert current is not threading.current_thread()
        assert not current.is_alive()  # and removal ended it
    final = pl.from_arrow(pq.read_table(out / "history.parquet"))
    assert isinstance(final, pl.DataFrame)
    assert_samples(final, steps, observer.run)


def test_flush_waits_for_queued_signals_whatever_the_scheduling(tmp_path: Path) -> None:
    out = tmp_path / "stats"
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sink = GatedDirectorySink(out)
    inject_observer(model, sink=sink, sampler=AlwaysSampler())
    observer = attached(model)
    try:
        for step, (x, y) in enumerate(batches(3)):
            train_step(model, optimizer, x, y)  # its writes now wait for a flush
            # the worker is inside a write, waiting: its thread is running now
            thread = observer.emission_thread
            assert thread is not None
            assert thread is not threading.current_thread()
            sink.flush()
            sink.gate = threading.Event()  # nothing is queued now: the next step waits again
            assert_samples(scan_history(out).collect(), step + 1, observer.run)
    finally:
        sink.gate.set()
        remove_observer(model)


EXIT_SCRIPT = """
import sys
from pathlib import Path

import torch

sys.path.insert(0, {tests!r})
from test_io_background_writes import (
    GatedDirectorySink, attached, batches, make_model, train_step
)

from ti_core import AlwaysSampler, inject_observer
from ti_core.reduction import placement

placement.INLINE_SIGNAL_BYTES = -1  # every signal queued on the worker, small ones too
model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
sink = GatedDirectorySink(Path({out!r}))
inject_observer(model, sink=sink, sampler=AlwaysSampler())
for x, y in batches({steps}):
    train_step(model, optimizer, x, y)
# every write waits for the exit flush's barrier: the worker is busy, its thread running
assert attached(model).emission_thread is not None
assert not sink.gate.is_set()
# exits without remove_observer: the exit flush must publish every sample
"""


def test_exit_flush_publishes_every_queued_signal(tmp_path: Path) -> None:
    steps = 3
    out = tmp_path / "stats"
    script = EXIT_SCRIPT.format(tests=str(Path(__file__).parent), out=str(out), steps=steps)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert not (out / "history.parquet").exists()  # not finalized: parts only
    model = make_model()
    frame = scan_history(out).collect()
    layers = len(list(model.children()))
    counts = frame.group_by("signal", "sample_id").len()
    assert sorted(counts.select("signal", "sample_id").rows()) == sorted(
        (signal, i) for signal in SIGNALS for i in range(steps)
    )
    metrics = frame["metric"].n_unique()
    assert counts["len"].to_list() == [layers * metrics] * (len(SIGNALS) * steps)


def test_tensorboard_sink_keeps_writes_on_the_training_thread(tmp_path: Path) -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    writer = SummaryWriter(str(tmp_path / "tb"))
    directory = DirectorySink(tmp_path / "stats")
    inject_observer(model, sink=[directory, TensorBoardSink(writer)], sampler=AlwaysSampler())
    observer = attached(model)
    try:
        for x, y in batches(2):
            train_step(model, optimizer, x, y)
        assert observer.emission_thread is None  # TensorBoardSink does not accept them
        directory.flush()
        assert_samples(scan_history(tmp_path / "stats").collect(), 2, observer.run)
    finally:
        remove_observer(model)
        writer.close()
