"""The same sampled root forwards on every observing rank of a ``torch.distributed`` job.

One rank, the leader, asks an :class:`~ti_core.sampling.AheadSchedule` which root forward it
samples next, one sample ahead, and publishes the index through a key-value store every rank
reaches (the default process group's store); the other ranks, the followers, read it at their
previous sample. Between samples no rank touches the store: an unsampled forward costs one
comparison, as with :class:`~ti_core.sampling.TimedSampler`.

The schedule, with ``i_0 = 0`` and the keys under ``{prefix}`` (``ti-sampling/{n}`` for the
``n``-th aligned observer attached in the process, 0-based, so each rank's ``n``-th observer is
aligned with the others' ``n``-th)::

    {prefix}/leader   the leader's rank; the first observing rank to attach claims it
    {prefix}/{k}      i_k, the index of the k-th sample (k >= 1), or "stop: ..." once the
                      leader fell back (followers then fall back at once, without waiting)

- forward 0: sampled on every rank (the first forward is sampled at once, as locally);
- forward 1 (the probe): the leader measures the seconds per forward, publishes ``i_1`` and
  ``i_2``; the followers read ``i_1`` (the one store read outside a sample);
- sample ``k >= 1`` (forward ``i_k``): the leader publishes ``i_{k+2}`` from the seconds per
  forward measured since its previous sample; the followers read ``i_{k+1}``, which the leader
  published a sample earlier, so it is normally there already.

A read waits for a missing key at most ``timeout`` (polling ``check``). Whatever fails (the
store raises, a key does not come in time, a value is malformed, the schedule misbehaves), the
rank falls back to the schedule's own ``should_sample`` (its own clock), with one
:class:`~ti_core.errors.TelemetryWarning`; the forward where it does is sampled. It never hangs.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
import warnings
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any, Final, Protocol, cast

from ti_core import _torch
from ti_core.errors import TelemetryWarning
from ti_core.ranks import RankPolicy, RankSelection
from ti_core.sampling import AheadSchedule, Sampler

DEFAULT_ALIGNMENT_TIMEOUT: Final = timedelta(seconds=10)
"""How long a follower waits for a key the leader has not published yet."""

SETTING: Final = "sampling_alignment"
"""The run setting (``RunInfo.settings``) that says how the samples were aligned."""

LOCAL: Final = "local: no default process group (each rank follows its own clock)"

_PROBE: Final = 1
_RUNS = itertools.count()  # the n of ``ti-sampling/{n}``: aligned observers bound in this process
_STOP: Final = b"stop"


class Store(Protocol):
    """The part of ``torch.distributed.Store`` used here (``TCPStore``, ``HashStore``,
    ``PrefixStore``, ``FileStore`` all have it)."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...


class _AlignmentError(Exception):
    """What went wrong, in words for the warning (the cause chained)."""


class AlignedSampler:
    """Samples, on every observing rank, the root forwards that the leader's schedule picks.

    ``inject_observer`` wraps its sampler in one when the sampler is an ``AheadSchedule`` (the
    default ``TimedSampler`` is), several ranks observe and a default process group is
    initialized. Pass one yourself to choose the ``store`` (any object with ``set``, ``get``,
    ``check`` and ``compare_set``; default: the default process group's store, found at attach),
    the ``timeout`` a follower waits for a key, or the ``key`` prefix (default
    ``ti-sampling/{n}``). ``clock`` (seconds, ``time.monotonic`` by default) measures the
    leader's seconds per forward; replaceable in tests.
    """

    def __init__(
        self,
        schedule: AheadSchedule,
        *,
        store: Store | None = None,
        timeout: timedelta | float = DEFAULT_ALIGNMENT_TIMEOUT,
        key: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(schedule, AheadSchedule):
            raise TypeError(
                "AlignedSampler(schedule=...) needs a sampler with should_sample(forward_index) "
                f"and next_index(sampled_index, seconds_per_forward), e.g. TimedSampler(30); "
                f"got {schedule!r}"
            )
        if store is not None and not all(
            callable(getattr(store, name, None)) for name in ("set", "get", "check", "compare_set")
        ):
            raise TypeError(
                "AlignedSampler(store=...) needs set, get, check and compare_set (a "
                f"torch.distributed.Store), got {store!r}"
            )
        if key is not None and (not isinstance(key, str) or not key):
            raise TypeError(f"AlignedSampler(key=...) must be a non-empty string, got {key!r}")
        if not callable(clock):
            raise TypeError(f"AlignedSampler(clock=...) must be callable, got {clock!r}")
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not math.isfinite(seconds)
            or seconds <= 0
        ):
            raise ValueError(
                f"AlignedSampler(timeout={timeout!r}) must be a positive timedelta or seconds, "
                "e.g. timedelta(seconds=10)"
            )
        self.schedule = schedule
        self.timeout = float(seconds)
        self._given_store = store
        self._given_key = key
        self._clock = clock
        self._lock = threading.Lock()
        self._store: Store | None = None
        self._prefix = ""
        self._rank = 0
        self.leader: int | None = None
        """The leader's rank once bound to a store (None: not aligned)."""
        self._local: Sampler | None = schedule  # not aligned until bound to a store
        self._next = 0
        self._count = 0  # samples taken (k of the next sample)
        self._probed = False
        self._scheduled: list[int] = []  # the leader's decided but not yet run samples
        self._published = 0  # the leader's highest k of {prefix}/{k} set
        self._previous = (0, 0.0)  # the leader's latest sample: (index, clock)
        self._warned = False

    @property
    def aligned(self) -> bool:
        """Whether this rank follows the shared schedule now (False before attach and after a
        fallback)."""
        return self._local is None

    @property
    def is_leader(self) -> bool:
        """Whether this rank decides the schedule (claimed the leader key at attach)."""
        return self.leader is not None and self.leader == self._rank

    def bind(self, rank: int) -> str:
        """Join the run's schedule as ``rank`` (at attach, before the first forward): claim the
        leader key or learn who holds it. Returns what the run setting ``sampling_alignment``
        records. A store that raises falls back (one warning)."""
        self._rank = rank
        self._prefix = self._given_key or f"ti-sampling/{next(_RUNS)}"
        claim = f"{self._prefix}/leader"
        try:
            store = self._given_store if self._given_store is not None else _torch.default_store()
            if store is None:
                self._local = self.schedule
                return LOCAL
            holder = store.compare_set(claim, "", str(rank))
            leader = int(bytes(holder).decode())
        except Exception as error:
            reason = f"claiming the store key {claim!r} failed ({error!r})"
            self._fall_back(_AlignmentError(reason), forward_index=None)
            return f"fallback: {reason}"
        self._store = store
        self.leader = leader
        self._local = None
        return f"store: leader rank {leader} (key {self._prefix!r})"

    def bind_meter(self, meter: Any) -> None:
        """Hand the run's cost meter (``ti_core.cost``) to the schedule when it reads one
        (``BudgetSampler``); the leader's decides for every rank."""
        bind = getattr(self.schedule, "bind_meter", None)
        if callable(bind):
            bind(meter)

    def reset(self) -> None:
        """Start over at root forward 0 (called at attach)."""
        with self._lock:
            self._next = 0
            self._count = 0
            self._probed = False
            self._scheduled = []
            self._published = 0
            self._previous = (0, 0.0)
        reset = getattr(self.schedule, "reset", None)
        if callable(reset):
            reset()

    def should_sample(self, forward_index: int) -> bool:
        local = self._local
        if local is not None:
            return bool(local.should_sample(forward_index))
        if forward_index < self._next:
            return False
        with self._lock:
            local = self._local
            if local is not None:
                return bool(local.should_sample(forward_index))
            if forward_index < self._next:
                return False
            try:
                return self._decide(forward_index)
            except _AlignmentError as failure:
                return self._fall_back(failure, forward_index)
            except Exception as error:  # the store or the schedule raised
                return self._fall_back(
                    _AlignmentError(f"the store or the schedule raised {error!r}"), forward_index
                )

    # ------------------------------------------------------------------ the schedule

    def _decide(self, index: int) -> bool:
        """Root forward ``index`` reached the next decision point (forward 0, the probe, or a
        sample); it is sampled when it is a sample's own index. The flight recorder's dense
        forwards skip the sampler, so a forward may arrive after a decision point: each point
        passed is still taken (the follower's read, the leader's publishing), in order."""
        sampled = False
        while index >= self._next:
            due = self._next
            if self._step(due, index) and due == index:
                sampled = True
        return sampled

    def _step(self, due: int, index: int) -> bool:
        """Take the decision point ``due`` at root forward ``index``; whether it is a sample."""
        if self._count == 0:  # forward 0
            self._count = 1
            self._previous = (index, self._clock())
            self._next = _PROBE
            return True
        if not self._probed:
            self._probed = True
            self._probe(index)
            return False
        self._sample(due, index)
        return True

    def _probe(self, index: int) -> None:
        if self.is_leader:
            now = self._clock()
            per_forward = self._per_forward(self._previous, (index, now))
            first = self._ask(0, per_forward)
            second = self._ask(first, per_forward)
            self._publish(1, first)
            self._publish(2, second)
            self._scheduled = [first, second]
            self._next = first
        else:
            self._next = self._read(1, after=0)

    def _sample(self, due: int, index: int) -> None:
        """Sample ``self._count`` (index ``due``), taken at ``index``: schedule the next one."""
        count = self._count
        self._count = count + 1
        if self.is_leader:
            now = self._clock()
            per_forward = self._per_forward(self._previous, (index, now))
            self._previous = (index, now)
            self._scheduled.pop(0)
            upcoming = self._scheduled[0]
            after = self._ask(upcoming, per_forward)
            self._publish(count + 2, after)
            self._scheduled.append(after)
            self._next = upcoming
        else:
            self._next = self._read(count + 1, after=due)

    def _per_forward(self, start: tuple[int, float], end: tuple[int, float]) -> float:
        forwards = end[0] - start[0]
        seconds = (end[1] - start[1]) / forwards if forwards > 0 else 0.0
        return seconds if seconds > 0 else 1e-9

    def _ask(self, sampled_index: int, per_forward: float) -> int:
        decided = self.schedule.next_index(sampled_index, per_forward)
        if isinstance(decided, bool) or not isinstance(decided, int) or decided <= sampled_index:
            raise _AlignmentError(
                f"{self.schedule!r}.next_index({sampled_index}, {per_forward:.3g}) returned "
                f"{decided!r}, not an int greater than {sampled_index}"
            )
        return decided

    def _publish(self, k: int, value: int | str) -> None:
        store = cast(Store, self._store)
        key = f"{self._prefix}/{k}"
        try:
            store.set(key, str(value))
        except Exception as error:
            raise _AlignmentError(f"publishing the store key {key!r} failed ({error!r})") from error
        self._published = k

    def _read(self, k: int, *, after: int) -> int:
        store = cast(Store, self._store)
        key = f"{self._prefix}/{k}"
        deadline = time.monotonic() + self.timeout
        pause = 0.001
        try:
            while not store.check([key]):
                if time.monotonic() >= deadline:
                    raise _AlignmentError(
                        f"the store key {key!r} was not published by the leader (rank "
                        f"{self.leader}) within {self.timeout:g} s"
                    )
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
            raw = bytes(store.get(key))
        except _AlignmentError:
            raise
        except Exception as error:
            raise _AlignmentError(f"reading the store key {key!r} failed ({error!r})") from error
        if raw.startswith(_STOP):
            raise _AlignmentError(f"the leader (rank {self.leader}) fell back ({raw.decode()})")
        try:
            value = int(raw.decode())
        except ValueError:
            value = -1
        if value <= after:
            raise _AlignmentError(
                f"the store key {key!r} holds {raw!r}, not an index after {after}"
            )
        return value

    # ------------------------------------------------------------------ fallback

    def _fall_back(self, failure: _AlignmentError, forward_index: int | None) -> bool:
        """Follow the schedule's own clock from ``forward_index`` on (sampled), warn once; the
        leader tells the followers, when the store still answers."""
        if self.is_leader and self._store is not None:
            # the failure being reported is the one worth reporting
            with contextlib.suppress(Exception):
                self._store.set(f"{self._prefix}/{self._published + 1}", f"stop: {failure}")
        self._local = self.schedule
        reset = getattr(self.schedule, "reset", None)
        if callable(reset):
            reset()
        where = "at attach" if forward_index is None else f"at root forward {forward_index}"
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"aligned sampling on rank {self._rank} fell back to this rank's own clock "
                f"{where}: {failure}. From here on this rank samples by its own "
                f"{self.schedule!r}, so its samples need not be the same root forwards as "
                "other ranks' (compare_ranks(..., align_on='forward_index') matches only the "
                "forwards they share)",
                TelemetryWarning,
                stacklevel=2,
            )
        if forward_index is None:
            return False
        return bool(self.schedule.should_sample(forward_index))  # starts its own clock here

    def __repr__(self) -> str:
        return f"AlignedSampler({self.schedule!r})"


def _several_observe(policy: RankPolicy, selection: RankSelection) -> bool:
    """Whether other ranks may observe alongside this one: a rank-private directory (one rank
    alone writes ``output_dir`` itself) and not a policy that names a single rank."""
    if selection.world_size <= 1 or selection.subdir is None:
        return False
    listed: Any = getattr(policy, "ranks", None)
    return not (isinstance(listed, Collection) and len(listed) < 2)


def align(
    sampler: Sampler, policy: RankPolicy, selection: RankSelection
) -> tuple[Sampler, dict[str, str]]:
    """The sampler this observing rank uses, and the run settings that say so.

    An :class:`AlignedSampler` given is bound as it is. Another ``AheadSchedule`` is wrapped in
    one (bound: the leader claimed or learnt) when several ranks may observe and a default
    process group is initialized; without a process group it stays as it is, recorded as
    ``local``, and a fallback at attach leaves it as it is too. Any other sampler, or a single
    observing rank: unchanged, no setting (a single-process run is exactly as without this).
    """
    if isinstance(sampler, AlignedSampler):
        return sampler, {SETTING: sampler.bind(selection.rank)}
    if not isinstance(sampler, AheadSchedule) or not _several_observe(policy, selection):
        return sampler, {}
    aligned = AlignedSampler(sampler)
    setting = aligned.bind(selection.rank)
    return (aligned if aligned.aligned else sampler), {SETTING: setting}


__all__ = [
    "DEFAULT_ALIGNMENT_TIMEOUT",
    "LOCAL",
    "SETTING",
    "AlignedSampler",
    "Store",
    "align",
]
