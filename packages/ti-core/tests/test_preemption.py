"""Preemption: on SIGTERM (and at interpreter exit) the observers publish what they hold through
their sinks' declared ``flush``, then the signal goes on exactly as it would have.

In-process tests raise a real SIGTERM in this process with a Python handler installed first (so
the process survives); the default action is checked in a child process killed by the signal.
tests/test_reliability_preemption.py does the same with ti-io's DirectorySink and `ti
consolidate`.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from ti_core import (
    AlwaysSampler,
    MemorySink,
    SinkCapabilities,
    inject_observer,
    observer_of,
    preemption,
    remove_observer,
)
from ti_core.sink import RunInfo
from ti_schema import DEFAULT_METRICS

LAYERS = 3
ROWS_PER_STEP = LAYERS * 2 * len(DEFAULT_METRICS)  # outputs and output gradients


class FlushingSink:
    """Buffers what it receives and publishes it only on ``flush``, as a file sink does."""

    def __init__(self, *, blocked: threading.Event | None = None) -> None:
        self.pending: list[pa.RecordBatch] = []
        self.published: list[pa.RecordBatch] = []
        self.events: list[str] = []
        self.blocked = blocked
        self._lock = threading.Lock()

    def capabilities(self) -> SinkCapabilities:
        return SinkCapabilities(background_writes=True, flush=self.flush)

    def open(self, run: RunInfo) -> None:
        self.events.append("open")

    def write_history(self, batch: pa.RecordBatch) -> None:
        with self._lock:
            self.pending.append(batch)

    def write_histograms(self, batch: pa.RecordBatch) -> None:
        pass

    def flush(self) -> None:
        if self.blocked is not None:
            self.blocked.wait()
        with self._lock:
            self.published += self.pending
            self.pending = []
        self.events.append("flush")

    def close(self) -> None:
        self.events.append("close")

    def published_rows(self) -> int:
        return sum(b.num_rows for b in self.published)


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def _steps(model: nn.Module, n: int) -> None:
    for _ in range(n):
        model(torch.randn(3, 4)).pow(2).mean().backward()


@pytest.fixture
def previous() -> Iterator[list[str]]:
    """A Python SIGTERM handler installed before any observer, recording its calls (so a real
    SIGTERM raised here does not end the test process); the original one is restored."""
    calls: list[str] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        calls.append(signal.Signals(signum).name)

    original = signal.signal(signal.SIGTERM, handler)
    try:
        yield calls
    finally:
        signal.signal(signal.SIGTERM, original)


def test_sigterm_publishes_every_ended_signal_then_runs_the_previous_handler(
    previous: list[str],
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    model = _model()
    sink = FlushingSink()
    memory = MemorySink()
    inject_observer(model, output_dir=None, sink=[sink, memory], sampler=AlwaysSampler())
    try:
        handler = preemption.installed_handler()
        assert handler is not None
        assert signal.getsignal(signal.SIGTERM) is handler
        _steps(model, 4)
        sink.events.append("signal")
        signal.raise_signal(signal.SIGTERM)
        assert previous == ["SIGTERM"]  # passed on, once
        assert sink.events == ["open", "signal", "flush"]  # published before passing it on
        assert sink.published_rows() == 4 * ROWS_PER_STEP
        assert pa.Table.from_batches(sink.published).equals(memory.table())  # every row
        _steps(model, 1)  # the previous handler let training go on: still observed
    finally:
        remove_observer(model)
    assert signal.getsignal(signal.SIGTERM) is before  # removal restores the handler
    assert preemption.installed_handler() is None


def test_handle_sigterm_false_leaves_the_signal_alone(previous: list[str]) -> None:
    before = signal.getsignal(signal.SIGTERM)
    model = _model()
    sink = FlushingSink()
    inject_observer(
        model, output_dir=None, sink=sink, sampler=AlwaysSampler(), handle_sigterm=False
    )
    try:
        assert signal.getsignal(signal.SIGTERM) is before
        _steps(model, 2)
        signal.raise_signal(signal.SIGTERM)
        assert previous == ["SIGTERM"]
        assert "flush" not in sink.events
    finally:
        remove_observer(model)
    with pytest.raises(TypeError, match="handle_sigterm= must be True or False"):
        inject_observer(model, output_dir=None, sink=sink, handle_sigterm=1)  # type: ignore[arg-type]


def test_installed_only_from_the_main_thread_and_only_over_a_python_or_default_action(
    previous: list[str],
) -> None:
    model = _model()
    before = signal.getsignal(signal.SIGTERM)
    attach = threading.Thread(
        target=inject_observer,
        args=(model,),
        kwargs={"output_dir": None, "sink": MemorySink()},
    )
    attach.start()
    attach.join()
    try:
        assert signal.getsignal(signal.SIGTERM) is before  # another thread may not install it
    finally:
        remove_observer(model)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inject_observer(model, output_dir=None, sink=MemorySink())
    try:
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # ignored stays ignored
    finally:
        remove_observer(model)


def test_a_handler_installed_later_is_kept_and_still_reaches_ours(previous: list[str]) -> None:
    model = _model()
    sink = FlushingSink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    ours = signal.getsignal(signal.SIGTERM)
    assert callable(ours)
    later: list[str] = []

    def chaining(signum: int, frame: FrameType | None) -> None:  # e.g. a trainer's handler
        later.append("later")
        ours(signum, frame)

    signal.signal(signal.SIGTERM, chaining)
    try:
        _steps(model, 1)
        signal.raise_signal(signal.SIGTERM)
        assert later == ["later"]
        assert sink.published_rows() == ROWS_PER_STEP
        assert previous == ["SIGTERM"]
    finally:
        remove_observer(model)
    assert signal.getsignal(signal.SIGTERM) is chaining  # not ours to restore any more
    signal.raise_signal(signal.SIGTERM)  # ours, left in its chain, only passes the signal on
    assert (later, previous) == (["later", "later"], ["SIGTERM", "SIGTERM"])


def test_publication_is_bounded_in_time(
    previous: list[str], monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(preemption, "SIGTERM_PUBLISH_TIMEOUT_S", 0.3)
    stuck = threading.Event()  # a flush that cannot finish (a hung network file system)
    model = _model()
    sink = FlushingSink(blocked=stuck)
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    try:
        _steps(model, 1)
        signal.raise_signal(signal.SIGTERM)
        assert previous == ["SIGTERM"]  # passed on although the flush never returned
        assert "did not finish within 0.3 s" in capfd.readouterr().err
    finally:
        stuck.set()
        remove_observer(model)


def test_interpreter_exit_publishes_observers_that_were_never_removed() -> None:
    model = _model()
    sink = FlushingSink()
    inject_observer(
        model, output_dir=None, sink=sink, sampler=AlwaysSampler(), handle_sigterm=False
    )
    try:
        _steps(model, 3)
        preemption._publish_at_exit()  # what the atexit hook runs
        assert sink.published_rows() == 3 * ROWS_PER_STEP
    finally:
        remove_observer(model)
    observer = observer_of(model)
    assert observer is None


CHILD = textwrap.dedent(
    """
    import sys, time
    import pyarrow as pa, pyarrow.parquet as pq, torch
    from torch import nn
    from ti_core import AlwaysSampler, SinkCapabilities, inject_observer

    out = sys.argv[1]

    class FileSink:  # publishes what it buffered as one Parquet file per flush
        def __init__(self):
            self.pending, self.flushes = [], 0
        def capabilities(self):
            return SinkCapabilities(background_writes=True, flush=self.flush)
        def open(self, run): pass
        def write_history(self, batch): self.pending.append(batch)
        def write_histograms(self, batch): pass
        def flush(self):
            batches, self.pending = self.pending, []
            if batches:
                path = f"{out}/flush-{self.flushes}.parquet"
                pq.write_table(pa.Table.from_batches(batches), path)
                self.flushes += 1
        def close(self): pass

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    inject_observer(model, output_dir=None, sink=FileSink(), sampler=AlwaysSampler())
    step = 0
    while True:  # preempted from outside
        model(torch.randn(3, 4)).pow(2).mean().backward()
        step += 1
        print(step, flush=True)
        time.sleep(0.01)
    """
)


@pytest.mark.slow
def test_a_preempted_process_publishes_then_ends_as_sigterm_says(tmp_path: Path) -> None:
    # A user handler installed first runs after the publication, as in the in-process tests;
    # tests/test_reliability_preemption.py runs one in a child process too.
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    try:
        steps = 0
        deadline = time.monotonic() + 120
        while steps < 5:
            line = child.stdout.readline()
            assert line, "the training process ended on its own"
            steps = int(line)
            assert time.monotonic() < deadline
        child.send_signal(signal.SIGTERM)
        rest, _ = child.communicate(timeout=60)
    finally:
        child.kill()
        child.wait()
    steps = max([steps, *(int(line) for line in rest.split())])
    assert child.returncode == -signal.SIGTERM  # the default action, unchanged
    published = pa.concat_tables(pq.read_table(p) for p in sorted(tmp_path.glob("flush-*")))
    samples: Any = published.column("sample_id").to_pylist()
    for sample in range(steps):  # every step reported before the signal, complete
        assert samples.count(sample) == ROWS_PER_STEP, sample
