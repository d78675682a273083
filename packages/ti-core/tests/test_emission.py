"""Background emission: the worker thread that reduces and writes sampled signals.

Real models and training steps; no sleeps as synchronization and no timing assertions. Where a
test must know that a thread is waiting, it looks at that thread's Python stack (it is inside
``Condition.wait`` of the method under test), which is a fact, not a duration.
"""

from __future__ import annotations

import copy
import gc
import multiprocessing
import multiprocessing.queues
import queue
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from _core_helpers import assert_matches, reference, rows, stats
from torch import nn

import ti_core.emission.worker
from ti_core import (
    AlwaysSampler,
    MemorySink,
    Reducer,
    RunInfo,
    SinkCapabilities,
    TelemetryWarning,
    default_reducers,
    inject_observer,
    observer_of,
    remove_observer,
)
from ti_core.capture.gradients import GradientState
from ti_core.emission.worker import MAX_JOBS, EmissionWorker
from ti_core.observer import Observer
from ti_core.reduction.batch import TensorBatch
from ti_schema.testing import assert_history_conforms

SIGNALS = ("output", "output_gradient")
RUN_COLUMNS = ["run_id", "timestamp"]
"""Columns that differ between two runs of the same training (everything else must not)."""
DEADLINE_S = 60.0
"""Upper bound for a wait that a correct implementation ends at once (a hang guard only)."""


# These tests are about the worker and its queue: their small signals go to it too, instead of
# being written at once while it is idle (test_small_signals.py covers that).
pytestmark = pytest.mark.usefixtures("every_signal_queued")


# ----------------------------------------------------------------------------- helpers


def make_model() -> nn.Sequential:
    torch.manual_seed(1234)
    return nn.Sequential(
        nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


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


def per_signal_rows(run: RunInfo | None) -> int:
    """History rows of one sample and signal when every selected layer ran once."""
    assert run is not None
    return len(run.layers) * len(run.metrics)


def count(table: pa.Table, sample_id: int, signal: str) -> int:
    mask = pc.and_(pc.equal(table["sample_id"], sample_id), pc.equal(table["signal"], signal))
    return int(pc.sum(pc.cast(mask, pa.int64())).as_py() or 0)


def end_order(table: pa.Table) -> list[tuple[str, int]]:
    """(signal, sample_id) of consecutive row blocks, in the order the sink received them."""
    blocks: list[tuple[str, int]] = []
    for signal, sample in zip(
        table["signal"].to_pylist(), table["sample_id"].to_pylist(), strict=True
    ):
        if not blocks or blocks[-1] != (signal, sample):
            blocks.append((signal, sample))
    return blocks


def _float_bits(column: pa.ChunkedArray) -> np.ndarray:
    array = column.combine_chunks()
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        array = array.flatten()
    return np.asarray(array.fill_null(0.0).to_numpy(zero_copy_only=False)).view(np.uint64)


def assert_same_rows(got: pa.Table, expected: pa.Table) -> None:
    """Same rows in the same order, every column but the run's own; floats bit for bit."""
    assert got.num_rows == expected.num_rows
    assert got.num_rows > 0
    got, expected = got.drop_columns(RUN_COLUMNS), expected.drop_columns(RUN_COLUMNS)
    assert got.schema.names == expected.schema.names
    for name in got.schema.names:
        a, b = got[name], expected[name]
        assert a.type == b.type, name
        assert a.to_pylist() == b.to_pylist(), name
        value_type = a.type.value_type if pa.types.is_list(a.type) else a.type
        if pa.types.is_floating(value_type):
            np.testing.assert_array_equal(_float_bits(a), _float_bits(b), err_msg=name)


def _stack(thread: threading.Thread) -> list[FrameType]:
    frame = sys._current_frames().get(thread.ident or -1)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def _waiting_in(thread: threading.Thread, method: str) -> bool:
    """``thread`` is blocked in ``Condition.wait`` called from EmissionWorker.``method``."""
    frames = _stack(thread)
    return (
        bool(frames)
        and frames[0].f_code.co_name == "wait"
        and any(
            f.f_code.co_name == method and f.f_code.co_filename == ti_core.emission.worker.__file__
            for f in frames
        )
    )


def wait_until_blocked(thread: threading.Thread, method: str, returned: threading.Event) -> None:
    """Return once ``thread`` waits inside ``method``; fail if the call returns instead."""
    deadline = time.monotonic() + DEADLINE_S
    while not _waiting_in(thread, method):
        assert not returned.wait(0.005), f"{method} returned instead of waiting"
        assert time.monotonic() < deadline, f"{thread.name} never reached {method}'s wait"


class _Caller(threading.Thread):
    """Runs ``call`` on its own thread; ``returned`` is set (and ``result`` kept) when it ends."""

    def __init__(self, call: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self._call = call
        self.returned = threading.Event()
        self.result: object = None

    def run(self) -> None:
        self.result = self._call()
        self.returned.set()


@contextmanager
def telemetry_warnings() -> Iterator[list[tuple[str, int]]]:
    """Records (message, thread ident) of each TelemetryWarning shown, whichever thread."""
    shown: list[tuple[str, int]] = []

    def show(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, TelemetryWarning):
            shown.append((str(message), threading.get_ident()))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        yield shown


class ThreadRecordingSink(MemorySink):
    """A MemorySink (so background writes are accepted) that notes which thread wrote, and
    what the watched observer's ``emission_thread`` was during that write."""

    def __init__(self) -> None:
        super().__init__()
        self.observer: Observer | None = None
        """Held strongly: set it back to None to let the observer go."""
        self.writers: list[tuple[threading.Thread, threading.Thread | None]] = []
        self.writes_at_close: int | None = None

    def watch(self, observer: Observer) -> None:
        self.observer = observer

    def _note(self) -> None:
        emission = self.observer.emission_thread if self.observer is not None else None
        self.writers.append((threading.current_thread(), emission))

    def write_history(self, batch: pa.RecordBatch) -> None:
        self._note()
        super().write_history(batch)

    def write_histograms(self, batch: pa.RecordBatch) -> None:
        self._note()
        super().write_histograms(batch)

    def close(self) -> None:
        self.writes_at_close = len(self.writers)
        super().close()


def recording(model: nn.Module, **options: Any) -> tuple[ThreadRecordingSink, Observer]:
    """inject_observer with AlwaysSampler and a ThreadRecordingSink watching the observer."""
    sink = ThreadRecordingSink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler(), **options)
    observer = attached(model)
    sink.watch(observer)
    return sink, observer


def worker_threads(sink: ThreadRecordingSink) -> set[threading.Thread]:
    """Asserts every write ran on the observer's emission thread (read during that write:
    the thread is running a job then, so this holds whatever the idle exit does)."""
    assert sink.writers
    for current, emission in sink.writers:
        assert current is emission
        assert current is not threading.current_thread()
        assert current is not threading.main_thread()
    return {current for current, _ in sink.writers}


def assert_written_inline(sink: ThreadRecordingSink) -> None:
    assert sink.writers
    assert all(c is threading.current_thread() and e is None for c, e in sink.writers)


class GatedSink(MemorySink):
    """Its writes wait until a reader passes the observer's barrier.

    So a read that skipped the barrier finds the step's rows missing, whatever the scheduling:
    the barrier test is deterministic. ``gate`` is replaced by the test after each read.
    """

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.history_rows_written = 0

    def attach_barrier(self, barrier: Callable[[], None]) -> None:
        def opening() -> None:
            self.gate.set()
            barrier()

        super().attach_barrier(opening)

    def _pass(self) -> None:
        if not self.gate.wait(DEADLINE_S):
            raise TimeoutError("no read passed the barrier")

    def write_history(self, batch: pa.RecordBatch) -> None:
        self._pass()
        super().write_history(batch)
        self.history_rows_written += batch.num_rows

    def write_histograms(self, batch: pa.RecordBatch) -> None:
        self._pass()
        super().write_histograms(batch)


class PlainSink:
    """A user sink with the Sink protocol only (no ``capabilities()`` declaration)."""

    def __init__(self) -> None:
        self.threads: set[int] = set()
        self.rows = 0

    def open(self, run: RunInfo) -> None:
        pass

    def write_history(self, batch: pa.RecordBatch) -> None:
        self.threads.add(threading.get_ident())
        self.rows += batch.num_rows

    def write_histograms(self, batch: pa.RecordBatch) -> None:
        self.threads.add(threading.get_ident())

    def close(self) -> None:
        pass


class BrokenBackgroundSink:
    """Declares thread-safe writes, then fails every history write."""

    def capabilities(self) -> SinkCapabilities:
        return SinkCapabilities(background_writes=True)

    def __init__(self) -> None:
        self.failed_on: set[int] = set()

    def open(self, run: RunInfo) -> None:
        pass

    def write_history(self, batch: pa.RecordBatch) -> None:
        self.failed_on.add(threading.get_ident())
        raise OSError("disk full")

    def write_histograms(self, batch: pa.RecordBatch) -> None:
        pass

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------- equivalence


def _train(error_policy: str, steps: int) -> tuple[ThreadRecordingSink, dict[str, torch.Tensor]]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sink, _ = recording(model, error_policy=error_policy)
    for x, y in batches(steps):
        train_step(model, optimizer, x, y)
    remove_observer(model)
    return sink, {k: v.clone() for k, v in model.state_dict().items()}


def test_worker_and_inline_emission_give_identical_records() -> None:
    steps = 6
    background, state = _train("warn", steps)  # the default policy: the worker
    inline, inline_state = _train("raise", steps)  # everything on the training thread

    worker_threads(background)
    assert_written_inline(inline)
    run = background.run
    assert run is not None
    history, histograms = background.table(), background.histograms()
    assert history.num_rows == steps * len(SIGNALS) * per_signal_rows(run)
    assert histograms.num_rows == steps * len(SIGNALS) * len(run.focus_layers)
    assert_history_conforms(history)
    assert_same_rows(history, inline.table())
    assert_same_rows(histograms, inline.histograms())
    assert state.keys() == inline_state.keys()
    for name, tensor in state.items():  # the observer never touches training
        assert torch.equal(tensor, inline_state[name]), name


# ----------------------------------------------------------------------------- barrier


def test_reads_after_each_step_include_that_step() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sink, observer = recording(model)
    try:
        for step, (x, y) in enumerate(batches(5)):
            train_step(model, optimizer, x, y)
            table, histograms = sink.table(), sink.histograms()
            for signal in SIGNALS:
                assert count(table, step, signal) == per_signal_rows(observer.run), (step, signal)
                assert count(histograms, step, signal) == len(observer.run.focus_layers)
            assert table.num_rows == (step + 1) * len(SIGNALS) * per_signal_rows(observer.run)
        worker_threads(sink)
    finally:
        remove_observer(model)


def test_reads_wait_for_queued_signals_whatever_the_scheduling() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sink = GatedSink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    observer = attached(model)
    try:
        for step, (x, y) in enumerate(batches(4)):
            train_step(model, optimizer, x, y)  # its writes now wait for a read
            # the worker is inside a write, waiting: its thread is running now
            thread = observer.emission_thread
            assert thread is not None
            assert thread is not threading.current_thread()
            table = sink.table()
            histograms = sink.histograms()
            sink.gate = threading.Event()  # nothing is queued now: the next step waits again
            for signal in SIGNALS:
                assert count(table, step, signal) == per_signal_rows(observer.run), (step, signal)
                assert count(histograms, step, signal) == len(observer.run.focus_layers)
    finally:
        sink.gate.set()
        remove_observer(model)


def test_observer_drain_waits_for_every_ended_signal() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sink = GatedSink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    observer = attached(model)
    try:
        x, y = batches(1)[0]
        train_step(model, optimizer, x, y)
        drain = _Caller(observer.drain)
        drain.start()
        thread = observer.emission_thread  # inside a write, waiting: running now
        assert thread is not None
        assert thread is not threading.current_thread()
        wait_until_blocked(drain, "drain", drain.returned)
        sink.gate.set()
        drain.join(DEADLINE_S)
        assert drain.returned.is_set()
        # written before drain returned (read without the sink's barrier)
        assert sink.history_rows_written == len(SIGNALS) * per_signal_rows(observer.run)
    finally:
        sink.gate.set()
        remove_observer(model)


# ----------------------------------------------------------------------------- order


def test_rows_arrive_in_signal_end_order() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sink, _ = recording(model)
    data = batches(7)
    for x, y in data[:4]:
        train_step(model, optimizer, x, y)
    # three outstanding forwards, backpropagated out of order
    optimizer.zero_grad()
    y4, y5, y6 = (model(x) for x, _ in data[4:])
    y5.sum().backward()
    y6.sum().backward()
    y4.sum().backward()
    remove_observer(model)
    worker_threads(sink)

    expected = [(signal, step) for step in range(4) for signal in SIGNALS]
    expected += [("output", 4), ("output", 5), ("output", 6)]
    expected += [("output_gradient", 5), ("output_gradient", 6), ("output_gradient", 4)]
    assert end_order(sink.table()) == expected
    assert end_order(sink.histograms()) == expected


# ----------------------------------------------------------------------------- gradients


class Retaining(nn.Module):
    """Keeps (and retains the gradients of) each selected module's output when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6, dtype=torch.float64)
        self.act = nn.Tanh()
        self.out = nn.Linear(6, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor, keep: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.lin(x)
        a = self.act(h)
        y: torch.Tensor = self.out(a)
        for name, t in (("lin", h), ("act", a), ("out", y)):
            t.retain_grad()
            keep[name] = t
        return y


def test_outstanding_forwards_get_their_own_gradients_off_thread() -> None:
    model = Retaining()
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(5, 4, dtype=torch.float64, generator=g) for _ in range(3)]
    weights = torch.randn(5, 3, dtype=torch.float64, generator=g)
    sink, _ = recording(model)
    kept: list[dict[str, torch.Tensor]] = [{}, {}, {}]
    y0 = model(xs[0], kept[0])
    y1 = model(xs[1], kept[1])
    (3.0 * y1.sum()).backward()  # the second forward first
    (0.5 * (y0**2).sum()).backward()
    y2 = model(xs[2], kept[2])
    (y2 * weights).sum().backward()
    remove_observer(model)
    worker_threads(sink)

    table = sink.table()
    assert_history_conforms(table)
    for sample, keep in enumerate(kept):
        for layer, tensor in keep.items():
            assert tensor.grad is not None
            got = stats(table, sample_id=sample, layer=layer, signal="output_gradient")
            assert_matches(got, reference(tensor.grad.numpy()), rtol=1e-12)
            out = stats(table, sample_id=sample, layer=layer, signal="output")
            assert_matches(out, reference(tensor.detach().numpy()), rtol=1e-12)
            row = rows(table, sample_id=sample, layer=layer, signal="output_gradient")[0]
            assert row["forward_index"] == sample
    # the three samples' gradients differ, so a sample mix-up could not pass
    for layer in ("lin", "act", "out"):
        means = [stats(table, sample_id=s, layer=layer, signal="output_gradient") for s in range(3)]
        assert len({m["mean"] for m in means}) == 3


# ----------------------------------------------------------------------------- inline cases


def test_a_sink_without_background_writes_is_written_on_the_training_thread() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    memory, plain = MemorySink(), PlainSink()
    inject_observer(model, output_dir=None, sink=[memory, plain], sampler=AlwaysSampler())
    observer = attached(model)
    for x, y in batches(3):
        train_step(model, optimizer, x, y)
    assert observer.emission_thread is None
    remove_observer(model)
    assert plain.threads == {threading.get_ident()}
    assert plain.rows == memory.table().num_rows == 3 * len(SIGNALS) * per_signal_rows(memory.run)


def test_a_custom_reducer_keeps_reduction_on_the_training_thread() -> None:
    calls: set[int] = set()

    def abs_max(t: torch.Tensor) -> torch.Tensor:
        calls.add(threading.get_ident())
        return t.abs().max()

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sink, observer = recording(model, reducers=[*default_reducers(), Reducer("abs_max", abs_max)])
    for x, y in batches(2):
        train_step(model, optimizer, x, y)
    assert observer.emission_thread is None
    remove_observer(model)
    assert calls == {threading.get_ident()}
    assert_written_inline(sink)
    assert sink.run is not None
    assert len(rows(sink.table(), metric="abs_max")) == 2 * len(SIGNALS) * len(sink.run.layers)


def test_ignore_policy_uses_the_worker() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sink, _ = recording(model, error_policy="ignore")
    train_step(model, optimizer, *batches(1)[0])
    remove_observer(model)
    worker_threads(sink)
    assert sink.table().num_rows == len(SIGNALS) * per_signal_rows(sink.run)


# ----------------------------------------------------------------------------- failures


def test_worker_failures_warn_once_on_the_training_thread() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    broken, good = BrokenBackgroundSink(), MemorySink()
    main = threading.get_ident()
    data = batches(5)
    with telemetry_warnings() as shown:
        inject_observer(model, output_dir=None, sink=[broken, good], sampler=AlwaysSampler())
        observer = attached(model)
        train_step(model, optimizer, *data[0])
        good.table()  # the barrier: step 0's failed writes have happened, on the worker
        assert broken.failed_on
        assert main not in broken.failed_on
        assert shown == []  # deferred: nothing was shown on the worker thread
        model(data[1][0])  # the next root forward reports it
        assert len(shown) == 1
        for x, y in data[1:]:
            train_step(model, optimizer, x, y)
        observer.drain()
        remove_observer(model)
    assert len(shown) == 1
    message, thread_ident = shown[0]
    assert "disk full" in message
    assert "BrokenBackgroundSink" in message
    assert thread_ident == main
    table = good.table()
    for sample in range(len(data) + 1):  # the extra forward of data[1] is sample 1
        assert count(table, sample, "output") == per_signal_rows(good.run), sample
    assert count(table, 1, "output_gradient") == 0  # that forward had no backward
    for sample in (0, *range(2, len(data) + 1)):
        assert count(table, sample, "output_gradient") == per_signal_rows(good.run), sample


def test_worker_failure_is_reported_at_removal() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with telemetry_warnings() as shown:
        inject_observer(
            model, output_dir=None, sink=BrokenBackgroundSink(), sampler=AlwaysSampler()
        )
        train_step(model, optimizer, *batches(1)[0])
        remove_observer(model)
    assert [(("disk full" in m), t) for m, t in shown] == [(True, threading.get_ident())]


# ----------------------------------------------------------------------------- removal


def test_removal_writes_every_queued_signal_then_ends_the_worker() -> None:
    steps = 8
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sink, _ = recording(model)
    for x, y in batches(steps):
        train_step(model, optimizer, x, y)
    remove_observer(model)
    assert all(not thread.is_alive() for thread in worker_threads(sink))
    assert sink.close_count == 1
    assert sink.writes_at_close == len(sink.writers)  # every write came before the close
    table = sink.table()
    for sample in range(steps):
        for signal in SIGNALS:
            assert count(table, sample, signal) == per_signal_rows(sink.run), (sample, signal)
    assert table.num_rows == steps * len(SIGNALS) * per_signal_rows(sink.run)


# ----------------------------------------------------------------------------- leaks


def _live(kind: type) -> int:
    gc.collect()
    return sum(type(o) is kind for o in gc.get_objects())


def _live_tensors() -> int:
    gc.collect()
    return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())


def test_forwards_without_backward_leave_nothing_after_drain() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    model(torch.randn(4, 8))  # torch's own lazily created state, before counting
    snapshots_per_sample = 3
    states, tensors = _live(GradientState), _live_tensors()
    sink, observer = recording(model)
    for _ in range(2):
        for _ in range(50):
            out = model(torch.randn(4, 8))
            del out  # never backpropagated
        observer.drain()
        assert _live(GradientState) == states
        assert _live(TensorBatch) == 0  # the jobs' batches are gone with their jobs
        # What stays are idle snapshot buffers kept for reuse: at most one per snapshot that
        # was outstanding at once (MAX_JOBS queued, one more being captured), never one per
        # sample (100 samples here hold 300 snapshots).
        assert _live_tensors() - tensors <= (MAX_JOBS + 1) * snapshots_per_sample
    remove_observer(model)
    sink.observer = None
    del observer
    assert _live_tensors() == tensors  # the kept buffers go with the observer
    assert len({r["sample_id"] for r in rows(sink.table(), signal="output")}) == 100
    worker_threads(sink)


def test_outputs_are_freed_by_reference_counting_with_the_worker_on() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    inject_observer(model, output_dir=None, sink=MemorySink(), sampler=AlwaysSampler())
    baseline = _live(GradientState)
    refs = []
    for _ in range(20):
        out = model(torch.randn(4, 8))
        refs.append(weakref.ref(out))
        del out
    assert all(r() is None for r in refs)  # queued jobs hold snapshots, not the outputs
    attached(model).drain()
    assert _live(GradientState) == baseline
    remove_observer(model)


# ----------------------------------------------------------------------------- EmissionWorker


class Blocker:
    """A job that signals it started, then waits for ``release``."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> None:
        self.started.set()
        assert self.release.wait(DEADLINE_S)
        self.log.append(self.name)


def appender(log: list[str], name: str) -> Callable[[], None]:
    return lambda: log.append(name)


def test_worker_runs_jobs_in_order_on_one_thread() -> None:
    jobs = 3 * MAX_JOBS
    worker = EmissionWorker("test emission", max_bytes=1 << 20, max_jobs=jobs + 1)
    assert worker.thread is None  # started by the first job
    log: list[str] = []
    first = Blocker("first", log)
    ran: list[tuple[int, threading.Thread, threading.Thread | None]] = []
    try:
        assert worker.submit(first, nbytes=10)
        for i in range(jobs):  # all queued behind the first: they run back to back
            job = lambda i=i: ran.append((i, threading.current_thread(), worker.thread))  # noqa: E731
            assert worker.submit(job, nbytes=10)
    finally:
        first.release.set()
    worker.drain()
    assert log == ["first"]
    assert [i for i, _, _ in ran] == list(range(jobs))
    threads = {current for _, current, _ in ran}
    assert len(threads) == 1
    (thread,) = threads
    assert all(reported is thread for _, _, reported in ran)  # worker.thread while it runs
    assert thread is not threading.current_thread()
    worker.close()
    assert not thread.is_alive()


def test_submit_waits_while_max_jobs_are_queued() -> None:
    log: list[str] = []
    worker = EmissionWorker("test emission", max_bytes=1 << 20, max_jobs=3)
    first = Blocker("first", log)
    try:
        assert worker.submit(first, nbytes=1)
        assert first.started.wait(DEADLINE_S)  # running, and still counted as queued
        assert worker.submit(appender(log, "second"), nbytes=1)
        assert worker.submit(appender(log, "third"), nbytes=1)
        fourth = _Caller(lambda: worker.submit(appender(log, "fourth"), nbytes=1))
        fourth.start()
        wait_until_blocked(fourth, "submit", fourth.returned)
        assert not fourth.returned.is_set()
        assert log == []
    finally:
        first.release.set()
    fourth.join(DEADLINE_S)
    assert fourth.returned.is_set()
    assert fourth.result is True
    worker.drain()
    assert log == ["first", "second", "third", "fourth"]
    worker.close()


def test_submit_waits_while_the_byte_budget_is_exceeded() -> None:
    log: list[str] = []
    worker = EmissionWorker("test emission", max_bytes=100, max_jobs=MAX_JOBS)
    first = Blocker("first", log)
    try:
        assert worker.submit(first, nbytes=60)
        assert first.started.wait(DEADLINE_S)
        assert worker.submit(appender(log, "second"), nbytes=40)  # exactly the budget: queued
        third = _Caller(lambda: worker.submit(appender(log, "third"), nbytes=1))
        third.start()
        wait_until_blocked(third, "submit", third.returned)
        assert log == []
    finally:
        first.release.set()
    third.join(DEADLINE_S)
    assert third.result is True
    worker.drain()
    assert log == ["first", "second", "third"]
    worker.close()


def test_a_job_larger_than_the_budget_runs_when_the_queue_is_empty() -> None:
    log: list[str] = []
    worker = EmissionWorker("test emission", max_bytes=10)
    assert worker.submit(appender(log, "big"), nbytes=1000)
    worker.drain()
    assert log == ["big"]
    worker.close()


def test_drain_waits_for_the_running_job() -> None:
    log: list[str] = []
    worker = EmissionWorker("test emission", max_bytes=100)
    job = Blocker("job", log)
    try:
        assert worker.submit(job, nbytes=1)
        drain = _Caller(worker.drain)
        drain.start()
        wait_until_blocked(drain, "drain", drain.returned)
        assert log == []
    finally:
        job.release.set()
    drain.join(DEADLINE_S)
    assert drain.returned.is_set()
    assert log == ["job"]
    worker.close()


def test_drain_and_close_from_a_job_do_not_deadlock() -> None:
    log: list[str] = []
    worker = EmissionWorker("test emission", max_bytes=100)

    def nested() -> None:
        worker.drain()
        log.append("drained")

    assert worker.submit(nested, nbytes=1)
    worker.drain()
    assert log == ["drained"]
    worker.close()


def test_a_failing_job_does_not_stop_the_worker() -> None:
    log: list[str] = []
    worker = EmissionWorker("test emission", max_bytes=100)
    first = Blocker("first", log)
    threads: list[threading.Thread] = []

    def failing() -> None:
        threads.append(threading.current_thread())
        raise RuntimeError("job failed")

    try:
        assert worker.submit(first, nbytes=1)
        assert worker.submit(failing, nbytes=1)
        assert worker.submit(lambda: threads.append(threading.current_thread()), nbytes=1)
    finally:
        first.release.set()
    worker.drain()
    assert log == ["first"]
    assert len(threads) == 2
    assert threads[0] is threads[1]  # the same thread ran the job after the failing one
    worker.close()
    assert not threads[0].is_alive()


def test_close_runs_queued_jobs_and_refuses_later_ones() -> None:
    log: list[str] = []
    worker = EmissionWorker("test emission", max_bytes=1 << 20, max_jobs=2)
    first = Blocker("first", log)
    try:
        assert worker.submit(first, nbytes=1)
        assert first.started.wait(DEADLINE_S)
        assert worker.submit(appender(log, "second"), nbytes=1)
        waiting = _Caller(lambda: worker.submit(appender(log, "third"), nbytes=1))
        waiting.start()
        wait_until_blocked(waiting, "submit", waiting.returned)
        closer = _Caller(worker.close)
        closer.start()
        waiting.join(DEADLINE_S)  # close wakes the waiting submit: it must run its job itself
        assert waiting.returned.is_set()
        assert waiting.result is False
    finally:
        first.release.set()
    closer.join(DEADLINE_S)
    assert closer.returned.is_set()
    assert log == ["first", "second"]
    assert worker.thread is not None
    assert not worker.thread.is_alive()
    assert worker.submit(appender(log, "late"), nbytes=1) is False
    worker.drain()  # closed and empty: returns
    assert log == ["first", "second"]


def test_an_idle_worker_thread_ends_and_the_next_job_starts_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ti_core.emission.worker, "IDLE_EXIT_S", 0.001)
    worker = EmissionWorker("test emission", max_bytes=100)
    threads: list[threading.Thread] = []
    record = lambda: threads.append(threading.current_thread())  # noqa: E731
    assert worker.submit(record, nbytes=1)
    worker.drain()
    threads[0].join(DEADLINE_S)  # ends on its own once idle
    assert not threads[0].is_alive()
    assert worker.thread is None
    assert worker.submit(record, nbytes=1)
    worker.drain()
    assert len(threads) == 2
    assert threads[1] is not threads[0]
    worker.close()
    assert not threads[1].is_alive()
    assert worker.submit(record, nbytes=1) is False


def test_training_across_idle_exits_loses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ti_core.emission.worker, "IDLE_EXIT_S", 0.001)
    steps = 4
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sink, observer = recording(model)
    try:
        for step, (x, y) in enumerate(batches(steps)):
            train_step(model, optimizer, x, y)
            for signal in SIGNALS:
                assert count(sink.table(), step, signal) == per_signal_rows(observer.run)
            for thread in worker_threads(sink):  # let the worker go idle and end each step
                thread.join(DEADLINE_S)
                assert not thread.is_alive()
    finally:
        remove_observer(model)
    assert len(worker_threads(sink)) >= steps  # a fresh thread after each idle exit
    assert sink.table().num_rows == steps * len(SIGNALS) * per_signal_rows(observer.run)


def test_a_dropped_observer_leaves_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ti_core.emission.worker, "IDLE_EXIT_S", 0.001)
    model = make_model()
    sink, observer = recording(model)
    model(torch.randn(2, 12)).sum().backward()
    sink.table()
    threads = worker_threads(sink)
    ref = weakref.ref(observer)
    del model, observer, sink  # never removed
    gc.collect()
    assert ref() is None
    for thread in threads:
        thread.join(DEADLINE_S)
        assert not thread.is_alive()


def test_copies_of_an_observed_model_have_no_worker() -> None:
    model = make_model()
    inject_observer(model, output_dir=None, sink=MemorySink(), sampler=AlwaysSampler())
    try:
        model(torch.randn(2, 12)).sum().backward()
        clone = copy.deepcopy(model)
        assert observer_of(clone) is None
        clone(torch.randn(2, 12)).sum().backward()  # runs, unobserved
    finally:
        remove_observer(model)


def test_a_full_queue_holds_training_in_backward_and_loses_nothing() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sink = GatedSink()  # the worker waits in its first write: nothing leaves the queue
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    observer = attached(model)
    main = threading.current_thread()
    past_backward = threading.Event()
    stacks: list[list[str]] = []

    def open_once_training_waits() -> None:
        try:
            wait_until_blocked(main, "submit", past_backward)
            stacks.append([f.f_code.co_name for f in _stack(main)])
        finally:
            sink.gate.set()

    steps = (MAX_JOBS - 2) // 2  # two signals each
    data = batches(steps + MAX_JOBS)
    outputs = []
    opener = threading.Thread(target=open_once_training_waits, daemon=True)
    try:
        for x, y in data[:steps]:
            train_step(model, optimizer, x, y)
        optimizer.zero_grad()
        for x, _ in data[steps : steps + MAX_JOBS - 2 * steps]:  # fill the queue with outputs
            outputs.append(model(x))
        opener.start()
        outputs[0].sum().backward()  # its gradients wait for room, in the backward's callback
        past_backward.set()
        for out in outputs[1:]:
            out.sum().backward()
    finally:
        sink.gate.set()
        remove_observer(model)
    opener.join(DEADLINE_S)
    assert stacks, "training never waited for room in the queue"
    assert "flush" in stacks[0]  # GradientState.flush: the end-of-backward callback
    table = sink.table()
    for sample in range(steps + len(outputs)):
        for signal in SIGNALS:
            assert count(table, sample, signal) == per_signal_rows(observer.run), (sample, signal)


def _train_in_child(
    model: nn.Module, sink: MemorySink, steps: int, results: multiprocessing.queues.Queue[int]
) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(steps):
        train_step(model, optimizer, x, y)
    results.put(sink.table().num_rows)


def test_a_forked_child_trains_with_the_observer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hogwild-style training in forked processes: the parent's worker thread does not exist
    in the child, which must not queue signals for it (nothing would run them)."""
    monkeypatch.setattr(ti_core.emission.worker, "IDLE_EXIT_S", 3600.0)  # alive at the fork
    model = make_model()
    sink, observer = recording(model)
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.05), *batches(1)[0])
    sink.table()
    assert observer.emission_thread is not None
    steps = 2 * MAX_JOBS
    context = multiprocessing.get_context("fork")
    results: multiprocessing.queues.Queue[int] = context.Queue()
    child = context.Process(target=_train_in_child, args=(model, sink, steps, results))
    child.start()
    rows_in_child: int | None = None
    try:
        rows_in_child = results.get(timeout=DEADLINE_S)
    except queue.Empty:
        pytest.fail(f"the forked child did not finish {steps} training steps (it hangs)")
    finally:
        if rows_in_child is None:  # it hangs: do not wait for it
            child.kill()
        child.join(DEADLINE_S)
        remove_observer(model)
    assert child.exitcode == 0
    assert rows_in_child == (1 + steps) * len(SIGNALS) * per_signal_rows(sink.run)
