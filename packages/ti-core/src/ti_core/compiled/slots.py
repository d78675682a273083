"""The sentinel's flags under ``torch.compile``: slots of one tensor that graphs write.

(In :mod:`ti_core.compiled`: the traced code writes them; the flight recorder,
:mod:`ti_core.sentinel.recorder`, owns and reads them.)

A custom operator per checked call costs tens of microseconds (custom-op dispatch, the effect
token), more than a small compiled step's own work. Instead each checked output tensor of a
compiled graph has a *slot*, numbered at trace time, in one int64 tensor that the graph itself
updates (:func:`flag_into`, a mutation of a graph input, which the compiler keeps and fuses
like any other op). Every check increments a counter (:attr:`FlagSlots.sequence`); a check that
finds a non-finite entry writes the counter's value into its slot. A read
(:meth:`FlagSlots.read`, once per root forward) takes the slots written since the previous
read, in the order their checks ran: across graphs, graph breaks and recompiles, because
each call of a module in each compiled graph (and each eager call in a forward) has a slot of
its own. The reader never writes the tensors, so the graphs' write-back of their mutations
cannot undo a read. Once any graph has a slot, the recorder's eager output checks (code
between graph breaks, modules that run outside any graph) write slots too, so their order
against the graph's is exact as well; the root's own output, checked last, needs none.

Gradients get a :class:`FlagSlots` of their own, written by the backward graphs, only where
inductor compiles them on a torch release verified to write them in its own kernels
(``_torch.backward_writes_keep_versions``). A tensor a backward graph writes is saved
for that backward, and autograd refuses a saved tensor whose version counter moved: real
in-place kernels (``aot_eager``) bump it, so two forwards and then two backwards would break.
There, and under other backends, the ``ti::check_grad`` operator checks each gradient. No
Python runs when a backward graph ends, so the gradient slots are read when the next root
forward ends (and at removal), for the root forward that ended before the backward; once
they exist, the eager gradient checks write them too, so the order across graphs is exact.

Ownership: the flight recorder owns both :class:`FlagSlots`; the gate hands them to traced code
through its ``TraceFlags`` (the one source Dynamo reaches them by). The tensors live on the
device of the first slot asked for and are never replaced (compiled graphs guard on them); a
tensor on another device, or past :data:`CAPACITY` slots, gets none (the caller falls back to
the ``ti::check`` operator, which carries the counter's value so that :func:`merge` puts its
flags in place). Eager writes go through ``.data``: they leave the version counter alone. On an
accelerator the read is asynchronous: the slots are copied to the host behind a CUDA event and
the caller acts on the copy one root forward later.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable
from typing import Final

import torch
from torch import Tensor

Flagged = list[tuple[int, str]]
"""``(layer, tensor_path)`` of flagged tensors, in check order (``ti_core.sentinel.flags``
uses this one: it sits below the sentinel)."""

Keyed = list[tuple[int, tuple[int, str]]]
"""``(counter, (layer, tensor_path))`` of each flagged slot, in check order."""

CAPACITY: Final = 8192
"""Slots per run (64 KiB of int64): checked calls past it fall back to the operator."""


WIDE: Final[frozenset[torch.dtype]] = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64}
)
"""The floating dtypes that ``aminmax`` and ``sum`` take as they are."""


def can_be_nonfinite(dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` can hold a NaN or an infinity (floating and complex
    ones; integers and booleans cannot)."""
    return dtype.is_floating_point or dtype.is_complex


def real_view(values: Tensor) -> Tensor:
    """``values`` (floating or complex, detached) as a real tensor that ``aminmax`` and
    ``sum`` take, finite exactly where ``values`` is: complex as real pairs (a lazy
    conjugate resolved first, a copy: ``view_as_real`` refuses it), float8 and other narrow
    formats widened to float32 (they have no such kernels). The eager checks and the compiled
    graphs' alike."""
    dtype = values.dtype
    if dtype in WIDE:
        return values
    if dtype.is_complex:
        return torch.view_as_real(values.resolve_conj())
    return values.to(torch.float32)


def all_finite(values: Tensor) -> Tensor:
    """The compiled graphs' check of one tensor: a 0-d bool, true when every entry is finite,
    computed by a reduction the compiler fuses into the kernel that produced ``values``.

    ``aminmax`` where the size is known and not zero: its two are finite exactly when every
    entry is (NaN propagates to both), two vector operations per entry, about a fifth of
    ``isfinite(values).all()``'s in inductor's CPU kernels. That one where ``aminmax`` would
    raise (no entries) or might (a dynamic size). (Not ``(values * 0).sum()``: inductor folds a
    product with zero to zero, NaN or not.)"""
    numel = values.numel()
    if isinstance(numel, int) and numel > 0:
        low, high = torch.aminmax(values)
        return torch.isfinite(low) & torch.isfinite(high)
    return torch.isfinite(values).all()


def flag_into(slots: Tensor, sequence: Tensor, slot: int, values: Tensor) -> None:
    """Check ``values`` (a real floating tensor, detached: :func:`real_view`'s) into
    ``slot``: traced into compiled graphs, and run eagerly for the eager checks of a compiled
    run."""
    clean = all_finite(values)
    sequence.add_(1)
    # ``index_put_`` with a tensor index: inductor writes the one entry (``slots[slot] = v``
    # becomes a ``select_scatter`` that it lowers to a pass over every slot, per check).
    where = torch.full((1,), slot, dtype=torch.int64, device=slots.device)
    slots.index_put_((where,), torch.where(clean, slots[slot], sequence[0]).reshape(1))


class FlagSlots:
    """The slots of one flight recorder: their tensors, what each slot checks, their reads."""

    __slots__ = (
        "_cached",
        "_entries",
        "_lock",
        "_numbers",
        "_read_up_to",
        "_trace_calls",
        "gradient_hooks",
        "ran",
        "sequence",
        "slots",
    )

    def __init__(self) -> None:
        self.slots: Tensor | None = None
        """The flags (int64, :data:`CAPACITY`), on the device of the first slot asked for."""
        self.sequence: Tensor | None = None
        """The checks' counter (int64, one element), on the same device."""
        self.gradient_hooks = False
        """Whether a compiled graph checks the gradient of a slotted output (then a forward's
        clean outputs re-arm the sentinel only once its gradients are clean too)."""
        self._numbers: dict[tuple[int, str, Hashable, int], int] = {}
        self._entries: list[tuple[int, str]] = []
        self._trace_calls: dict[Hashable, dict[tuple[int, str], int]] = {}
        """Per compiled graph (its compile id), the calls traced so far per checked tensor."""
        self._read_up_to = 0
        """The counter's value at the last read: slots above it are new."""
        self._cached: tuple[int, Tensor] | None = None
        self.ran = False
        """Whether any check ran between the last two reads (set by each read; for an
        asynchronous one, when its result is taken)."""
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """Whether any slot exists (then the recorder's eager checks write slots too)."""
        return bool(self._entries)

    def traced_slot(self, trace: Hashable, layer: int, path: str, device: torch.device) -> int:
        """Trace time: the slot of the next call of ``layer`` (its tensor at ``path``) in the
        graph being traced (``trace``: its compile id); -1: none."""
        with self._lock:
            calls = self._trace_calls.setdefault(trace, {})
            occurrence = calls.get((layer, path), 0)
            calls[layer, path] = occurrence + 1
            return self._slot_locked((layer, path, trace, occurrence), device)

    def eager_slot(
        self, calls: dict[tuple[int, str], int], layer: int, path: str, device: torch.device
    ) -> int:
        """The slot of an eager call in a root forward (``calls``: that forward's count of
        its eager calls per tensor); -1: none."""
        occurrence = calls.get((layer, path), 0)
        calls[layer, path] = occurrence + 1
        with self._lock:
            return self._slot_locked((layer, path, None, occurrence), device)

    def _slot_locked(self, key: tuple[int, str, Hashable, int], device: torch.device) -> int:
        slots = self.slots
        if slots is None:
            self._make_locked(device)
        elif slots.device != device:
            return -1
        number = self._numbers.get(key)
        if number is None:
            if len(self._entries) >= CAPACITY:
                return -1
            number = self._numbers[key] = len(self._entries)
            self._entries.append((key[0], key[1]))
        return number

    def prepare(self, device: torch.device) -> bool:
        """Trace time: the tensors exist (made on ``device`` if none yet); False when they
        live on another device."""
        with self._lock:
            if self.slots is None:
                self._make_locked(device)
            return self.slots is not None and self.slots.device == device

    def _make_locked(self, device: torch.device) -> None:
        self.slots = torch.zeros(CAPACITY, dtype=torch.int64, device=device)
        self.sequence = torch.zeros(1, dtype=torch.int64, device=device)

    def flag(self, slot: int, values: Tensor) -> None:
        """An eager check into ``slot`` (``.data``: the version counters stay)."""
        assert self.slots is not None
        assert self.sequence is not None
        flag_into(self.slots.data, self.sequence.data, slot, values)

    def read(self, current: list[Tensor] | None = None) -> Keyed | PendingSlots:
        """The slots flagged since the last read, in check order; on an accelerator a
        :class:`PendingSlots` to ask later. ``current``: the slots and the counter as a
        graph hands them to an operator before it writes them back (its root hooks traced)."""
        slots, sequence = current if current else (self.slots, self.sequence)
        used = len(self._entries)  # (entries are only appended: the first ``used`` stay)
        self.ran = False
        if slots is None or sequence is None or not used:
            return []
        if slots.is_cpu:
            up_to = int(sequence.item())
            since = self._acted(up_to)
            if up_to == since:
                return []
            view = slots.data[:used] if current else self._view(used)
            if view.max().item() <= since:  # (one reduction and one scalar read: clean)
                return []
            return _in_order(self._entries[:used], view.tolist(), since)
        view = slots.data[:used]
        return PendingSlots(self, torch.cat([sequence.data, view]), self._entries[:used])

    def _view(self, used: int) -> Tensor:
        """The first ``used`` slots (an alias, made once per number of slots)."""
        cached = self._cached
        if cached is not None and cached[0] == used:
            return cached[1]
        assert self.slots is not None  # (the caller read them)
        view = self.slots.data[:used]
        self._cached = (used, view)
        return view

    def _acted(self, up_to: int) -> int:
        """A read took the counter at ``up_to``: the value the previous read took."""
        since, self._read_up_to = self._read_up_to, up_to
        self.ran = up_to != since
        return since


def _in_order(entries: list[tuple[int, str]], values: list[int], since: int) -> Keyed:
    flagged = sorted((value, number) for number, value in enumerate(values) if value > since)
    return [(value, entries[number]) for value, number in flagged]


def merge(slotted: Keyed, flagged: Flagged, keys: list[float]) -> Flagged:
    """One forward's flagged tensors in check order: the slots' (by their counter) and those
    checked without a slot (``keys``: the counter when each was checked, infinity when
    unknown), each of the latter after the slot checks that ran before it."""
    if not flagged:
        return [entry for _, entry in slotted]
    if not slotted:
        return flagged
    order = [(float(value), 0, n, entry) for n, (value, entry) in enumerate(slotted)]
    for n, entry in enumerate(flagged):
        key = keys[n] if n < len(keys) else math.inf
        order.append((key + 0.5, 1, n, entry))
    return [entry for *_, entry in sorted(order)]


class PendingSlots:
    """A read of the slots in flight from an accelerator: :meth:`ready`, then :meth:`result`
    (results are taken in the order the reads were asked for)."""

    __slots__ = ("_entries", "_event", "_host", "_owner")

    def __init__(self, owner: FlagSlots, values: Tensor, entries: list[tuple[int, str]]) -> None:
        self._owner = owner
        self._entries = entries
        self._host = values.to("cpu", non_blocking=True)
        self._event: object | None = None
        if values.device.type == "cuda":
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(values.device))
            self._event = event

    def ready(self) -> bool:
        return self._event is None or bool(self._event.query())  # type: ignore[attr-defined]

    def result(self) -> Keyed:
        if self._event is not None:
            self._event.synchronize()  # type: ignore[attr-defined]
        values = self._host.tolist()
        since = self._owner._acted(values[0])
        return _in_order(self._entries, values[1:], since)


__all__ = ["CAPACITY", "FlagSlots", "Keyed", "PendingSlots", "all_finite", "flag_into", "merge"]
