"""Where each tensor is reduced: the decisions of ``ti_core.reduction.placement``, and that the
emitter and the batch follow them."""

from __future__ import annotations

import threading

import pytest
import torch

from ti_core import AlwaysSampler, MemorySink, inject_observer, observer_of, remove_observer
from ti_core.reduction import placement
from ti_core.reduction.placement import SignalThread, signal_thread
from ti_core.sink import SinkCapabilities

SMALL = placement.INLINE_SIGNAL_BYTES
BIG = placement.INLINE_SIGNAL_BYTES + 1


@pytest.mark.parametrize(
    ("pending", "host_only", "idle", "expected"),
    [
        (SMALL, True, True, SignalThread.HERE),
        (SMALL, False, True, SignalThread.HERE),
        (SMALL, True, False, SignalThread.WORKER),
        (BIG, True, True, SignalThread.WORKER),
        (BIG, False, True, SignalThread.HERE_AFTER_QUEUE),
        (SMALL, False, False, SignalThread.HERE_AFTER_QUEUE),
    ],
)
def test_an_ended_signal_goes_where_its_size_device_and_the_queue_say(
    pending: int, host_only: bool, idle: bool, expected: SignalThread
) -> None:
    assert signal_thread(pending, host_only, worker_idle=idle) is expected


def test_the_worker_is_allowed_only_without_user_code_raising_or_training_thread_sinks() -> None:
    background = SinkCapabilities(background_writes=True)
    inline = SinkCapabilities(background_writes=False)
    allowed = placement.worker_allowed
    assert allowed(default_only=True, raises=False, capabilities=[background, background])
    assert not allowed(default_only=False, raises=False, capabilities=[background])
    assert not allowed(default_only=True, raises=True, capabilities=[background])
    assert not allowed(default_only=True, raises=False, capabilities=[background, inline])


def test_a_tensor_is_reduced_at_once_when_it_overflows_the_snapshot_budget() -> None:
    budget = placement.SNAPSHOT_BUDGET_BYTES
    assert not placement.reduce_at_once(budget - 8, 8)
    assert placement.reduce_at_once(budget - 8, 9)
    assert placement.reduce_at_once(0, budget + 1)


def test_a_reduction_at_once_shares_its_work_only_when_torch_may_use_threads() -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert not placement.share_at_once()
        torch.set_num_threads(2)
        assert placement.share_at_once()
    finally:
        torch.set_num_threads(threads)


def test_the_emitter_follows_the_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every signal sent to the worker, the rows are written off the training thread;
    with every signal kept here, on it."""
    writers: list[str] = []

    class Recording(MemorySink):
        def write_history(self, batch):  # type: ignore[no-untyped-def]
            writers.append(threading.current_thread().name)
            super().write_history(batch)

    def run(decision: SignalThread) -> list[str]:
        writers.clear()
        monkeypatch.setattr(
            "ti_core.emission.emitters.signal_thread", lambda *args, **kwargs: decision
        )
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        sink = Recording()
        inject_observer(model, sink=sink, output_dir=None, sampler=AlwaysSampler())
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
        observer = observer_of(model)
        assert observer is not None
        observer.drain()
        remove_observer(model)
        assert sink.table().num_rows > 0
        return list(writers)

    here = threading.current_thread().name
    assert set(run(SignalThread.HERE)) == {here}
    assert set(run(SignalThread.HERE_AFTER_QUEUE)) == {here}
    assert here not in run(SignalThread.WORKER)
