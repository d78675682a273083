"""Aligned sampling (ti_core.aligned_sampling) against real torch.distributed stores in one
process: a leader and followers sharing a ``HashStore`` / ``TCPStore`` sample the same root
forwards; a store that raises, a leader that never publishes, a leader that falls back, and a
schedule that misbehaves each fall back with one warning and never hang."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ti_core import (
    MemorySink,
    TelemetryWarning,
    TimedSampler,
    inject_observer,
    observer_of,
    remove_observer,
)
from ti_core.aligned_sampling import LOCAL, SETTING, AlignedSampler, align
from ti_core.ranks import RankSelection


class FakeClock:
    """A clock that advances ``step`` seconds per call of :meth:`tick` (one forward)."""

    def __init__(self, step: float) -> None:
        self.step = step
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.step


def _samplers(
    store: Any, clocks: list[FakeClock], interval: float = 1.0, timeout: float = 5.0
) -> list[AlignedSampler]:
    out = []
    for rank, clock in enumerate(clocks):
        sampler = AlignedSampler(
            TimedSampler(interval, clock=clock), store=store, key="t", timeout=timeout, clock=clock
        )
        assert sampler.bind(rank) == "store: leader rank 0 (key 't')"
        sampler.reset()
        out.append(sampler)
    return out


def _telemetry_warnings(run: Callable[[], object]) -> list[str]:
    """The TelemetryWarnings ``run()`` emits (every other warning fails the test)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    other = [w for w in caught if not issubclass(w.category, TelemetryWarning)]
    assert not other, [str(w.message) for w in other]
    return [str(w.message) for w in caught]


def _lockstep(samplers: list[AlignedSampler], clocks: list[FakeClock], n: int) -> list[list[int]]:
    """Every rank runs forward i before any runs i + 1 (the leader first: within a step a
    follower ahead of it is the threaded test's case)."""
    sampled: list[list[int]] = [[] for _ in samplers]
    for index in range(n):
        for rank, (sampler, clock) in enumerate(zip(samplers, clocks, strict=True)):
            if sampler.should_sample(index):
                sampled[rank].append(index)
            clock.tick()
    return sampled


def test_timed_next_index_is_one_interval_of_forwards() -> None:
    timed = TimedSampler(1.0)
    assert timed.next_index(5, 0.25) == 9
    assert timed.next_index(5, 0.3) == 9  # ceil(3.33): the first forward after the interval
    assert timed.next_index(5, 2.0) == 6  # a forward longer than the interval: the next one
    assert timed.next_index(0, 0.0) > 10**8  # a clock too coarse to see a forward: far ahead


@pytest.mark.parametrize("kind", ["hash", "tcp"])
def test_every_rank_samples_the_leaders_schedule(kind: str) -> None:
    store: Any = (
        dist.HashStore()
        if kind == "hash"
        else dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), wait_for_workers=False)
    )
    # the leader at 0.125 s per forward; followers whose clocks run at other speeds do not matter
    clocks = [FakeClock(0.125), FakeClock(0.5), FakeClock(0.0625), FakeClock(0.125)]
    samplers = _samplers(store, clocks)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampled = _lockstep(samplers, clocks, 60)
    assert sampled[0] == list(range(0, 60, 8))  # next_index(i, 0.125) = i + 8
    assert all(s == sampled[0] for s in sampled)
    assert all(s.aligned for s in samplers)
    assert [s.is_leader for s in samplers] == [True, False, False, False]


def test_forwards_that_skip_the_sampler_keep_the_schedule() -> None:
    """The flight recorder's dense forwards do not ask the sampler: a rank that skips a
    scheduled index still samples the later ones with the others."""
    store = dist.HashStore()
    clocks = [FakeClock(0.125), FakeClock(0.125), FakeClock(0.125)]
    samplers = _samplers(store, clocks)
    skipped = [{8, 9}, {1, 8, 16, 17}, set()]  # the leader skips sample 1; rank 1 the probe
    sampled: list[list[int]] = [[] for _ in samplers]
    for index in range(40):
        for rank, sampler in enumerate(samplers):
            if index not in skipped[rank] and sampler.should_sample(index):
                sampled[rank].append(index)
            clocks[rank].tick()
    assert sampled[2] == [0, 8, 16, 24, 32]
    assert sampled[0] == [0, 16, 24, 32]
    assert sampled[1] == [0, 24, 32]
    assert all(s.aligned for s in samplers)


def test_follower_ahead_within_the_timeout_waits_for_the_leader() -> None:
    store = dist.HashStore()
    clocks = [FakeClock(0.125), FakeClock(0.125)]
    leader, follower = _samplers(store, clocks)
    assert leader.should_sample(0)
    assert follower.should_sample(0)
    # the follower reaches the probe (forward 1) before the leader has published i_1
    answer: list[bool] = []
    thread = threading.Thread(target=lambda: answer.append(follower.should_sample(1)))
    thread.start()
    clocks[0].tick()
    leader.should_sample(1)
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert answer == [False]
    assert follower.aligned


def test_leader_that_never_publishes_falls_back_after_the_timeout() -> None:
    store = dist.HashStore()
    clock = FakeClock(0.125)
    AlignedSampler(TimedSampler(1.0), store=store, key="t").bind(0)  # a leader that never runs
    follower = AlignedSampler(
        TimedSampler(1.0, clock=clock), store=store, key="t", timeout=0.2, clock=clock
    )
    follower.bind(1)
    follower.reset()
    decisions: list[bool] = []

    def run() -> None:
        for index in range(30):
            decisions.append(follower.should_sample(index))
            clock.tick()

    caught = _telemetry_warnings(run)
    assert len(caught) == 1
    message = caught[0]
    assert "rank 1 fell back to this rank's own clock at root forward 1" in message
    assert "'t/1' was not published by the leader (rank 0) within 0.2 s" in message
    assert not follower.aligned
    # forward 0 as aligned, forward 1 starts the rank's own clock, then every 8 forwards
    assert [i for i, d in enumerate(decisions) if d] == [0, 1, 9, 17, 25]


class FlakyStore:
    """A ``HashStore`` whose ``set`` raises the ``fail_at``-th time (1-based), once."""

    def __init__(self, fail_at: int) -> None:
        self.inner = dist.HashStore()
        self.sets = 0
        self.fail_at = fail_at

    def set(self, key: str, value: str) -> None:
        self.sets += 1
        if self.sets == self.fail_at:
            raise RuntimeError("store unreachable")
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self.inner.get(key))

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        return bytes(self.inner.compare_set(key, expected_value, desired_value))


def test_leader_whose_store_fails_tells_the_followers() -> None:
    store = FlakyStore(fail_at=3)  # the probe sets keys 1 and 2; sample 1's key 3 fails
    clocks = [FakeClock(0.125), FakeClock(0.125)]
    # a follower timeout far longer than the test: it falls back on the leader's stop marker
    samplers = _samplers(store, clocks, timeout=600)
    sampled: list[list[int]] = []
    messages = _telemetry_warnings(lambda: sampled.extend(_lockstep(samplers, clocks, 40)))
    assert len(messages) == 2, messages
    assert "rank 0 fell back" in messages[0]
    assert "'t/3' failed" in messages[0]
    assert "rank 1 fell back" in messages[1]
    assert "the leader (rank 0) fell back" in messages[1]
    assert not any(s.aligned for s in samplers)
    # aligned up to sample 1 (forward 8); the leader's own clock from there, the follower's
    # from sample 2 (forward 16), where it read the stop marker
    assert sampled[0] == [0, 8, 16, 24, 32]
    assert sampled[1] == [0, 8, 16, 24, 32]


class RaisingStore:
    def set(self, key: str, value: str) -> None:
        raise RuntimeError("store down")

    def get(self, key: str) -> bytes:
        raise RuntimeError("store down")

    def check(self, keys: list[str]) -> bool:
        raise RuntimeError("store down")

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        raise RuntimeError("store down")


class TwoRanks:
    """A rank policy: rank 1 of 2, writing into its own directory."""

    def select(self) -> RankSelection:
        return RankSelection(rank=1, world_size=2, observe=True, subdir="rank-001")


def _train(model: nn.Module, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()


def test_store_that_raises_at_attach_falls_back_with_one_warning() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    sink = MemorySink()
    sampler = AlignedSampler(TimedSampler(3600.0), store=RaisingStore())

    def run() -> None:
        inject_observer(model, sink=sink, output_dir=None, sampler=sampler, rank_policy=TwoRanks())
        _train(model, 3)

    caught = _telemetry_warnings(run)
    observer = observer_of(model)
    assert observer is not None
    setting = observer.run.settings[SETTING]
    remove_observer(model)
    assert len(caught) == 1
    assert "rank 1 fell back to this rank's own clock at attach" in caught[0]
    assert setting.startswith("fallback: claiming the store key 'ti-sampling/")
    assert "store down" in setting
    assert set(sink.table().column("forward_index").to_pylist()) == {0}  # its own clock


def test_schedule_that_does_not_move_forward_falls_back() -> None:
    class Stuck(TimedSampler):
        def next_index(self, sampled_index: int, seconds_per_forward: float) -> int:
            return sampled_index

    clock = FakeClock(0.125)
    leader = AlignedSampler(Stuck(1.0, clock=clock), store=dist.HashStore(), key="t", clock=clock)
    leader.bind(0)
    leader.reset()
    assert leader.should_sample(0)
    clock.tick()
    decided: list[bool] = []
    caught = _telemetry_warnings(lambda: decided.append(leader.should_sample(1)))
    assert decided == [True]  # the fallback forward starts the rank's own clock
    assert len(caught) == 1
    assert "next_index(0, 0.125) returned 0, not an int greater than 0" in caught[0]
    assert not leader.aligned


def test_which_jobs_are_aligned() -> None:
    timed = TimedSampler(60.0)
    single = RankSelection(rank=0, world_size=1, observe=True, subdir=None)
    rank0 = RankSelection(rank=0, world_size=4, observe=True, subdir=None)
    every = RankSelection(rank=1, world_size=4, observe=True, subdir="rank-001")

    class OneListed:
        ranks = frozenset({1})

        def select(self) -> RankSelection:
            return every

    assert align(timed, TwoRanks(), single) == (timed, {})
    assert align(timed, TwoRanks(), rank0) == (timed, {})  # one rank writes output_dir itself
    assert align(timed, OneListed(), every) == (timed, {})
    # several ranks but no process group: the rank's own clock, said in the settings
    assert align(timed, TwoRanks(), every) == (timed, {SETTING: LOCAL})


def test_single_process_run_is_unchanged() -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inject_observer(model, sink=MemorySink(), output_dir=None)
    observer = observer_of(model)
    assert observer is not None
    assert SETTING not in observer.run.settings
    assert observer.run.sampler == "TimedSampler(interval=60s)"
    remove_observer(model)


def test_the_private_store_accessor_exists() -> None:
    """ti_core._torch.default_store relies on this name of the pinned torch."""
    from torch.distributed import distributed_c10d

    from ti_core._torch import default_store

    assert callable(distributed_c10d._get_default_store)
    assert default_store() is None  # no process group in this test
