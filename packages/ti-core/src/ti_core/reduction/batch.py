"""One sample's tensors of one signal: snapshots at the module boundary, reduced in batches.

Ownership: a :class:`TensorBatch` is filled by the thread that captures (a sampled forward, or a
backward delivering gradients) and finished once, by whoever emits the signal (that thread, or
the emission worker). It holds snapshots, never the live tensors it was given, except a tensor
too big for the snapshot budget, which is reduced at once, in place
(:mod:`ti_core.reduction.placement` decides where each tensor is reduced).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ti_core import _torch
from ti_core.entries import Entries, Entry
from ti_core.reduction import layout, placement
from ti_core.reduction.histograms import DEFAULT_BINS, HistogramRows
from ti_core.reduction.plan import ReductionPlan
from ti_core.reduction.sharding import is_sharded, measurable, placements_suffix, shape_of
from ti_core.reduction.slots import SlotReduction
from ti_core.reduction.snapshots import SnapshotPool
from ti_core.reduction.support import dtype_name
from ti_schema import PLACEMENT_MISMATCH_REASON


def tensor_version(tensor: torch.Tensor) -> int | None:
    """The version counter of ``tensor`` (bumped by in-place writes); None for inference tensors."""
    try:
        return _torch.version(tensor)
    except RuntimeError:  # inference tensors have no version counter
        return None


@dataclass
class Reduced:
    """Measurements of a batch of entries, aligned with ``entries``."""

    entries: Entries
    values: np.ndarray
    available: np.ndarray
    reasons: Sequence[list[str | None]]
    errors: list[BaseException]
    histogram_entries: Entries = field(default_factory=Entries)
    histograms: HistogramRows = field(
        default_factory=lambda: HistogramRows(np.zeros((0, layout.histogram_width(1))), 1)
    )


Row = tuple[int, int, str, bool, bool, int]
"""One entry as capture records it: ``(layer, call_index, path, train, grad_enabled, slot)``,
its time in a list beside it. A tuple of atomic values: one allocation per module call, which
the cyclic collector stops tracking at its next pass (an object per entry made its full passes
frequent on wide models). Without the time, a training loop records equal rows sample after
sample, which :class:`StructureMemo` turns into reused columns."""

_TOKENS = itertools.count(1)
_Columns = tuple[
    list[int], list[int], list[str], list[bool], list[bool], list[tuple[int, ...]], list[str]
]


class EntryStructure:
    """Entries without their times: the identity columns and the slot of each entry. Built
    once and reused by every later batch whose rows, slots, shapes and dtypes are equal; its
    token (:attr:`ti_core.entries.Entries.key`) names it to the record batches, which then reuse
    the identity columns they built for it. Never changed once built; shared across threads."""

    __slots__ = ("_histograms", "columns", "slot_of", "token")

    def __init__(self, columns: _Columns, slot_of: list[int]) -> None:
        self.columns = columns
        self.slot_of = slot_of
        self.token = next(_TOKENS)
        self._histograms: (
            tuple[frozenset[int], frozenset[int], list[int], EntryStructure | None] | None
        ) = None

    @classmethod
    def of_rows(
        cls, rows: Sequence[Row], shapes: list[tuple[int, ...]], dtypes: list[str]
    ) -> EntryStructure:
        """The structure of ``rows`` (at least one), whose slots have ``shapes`` and ``dtypes``."""
        layer, call_index, path, train, grad_enabled, slot_of = (
            list(c) for c in zip(*rows, strict=True)
        )
        return cls(
            (
                layer,
                call_index,
                path,
                train,
                grad_enabled,
                [shapes[s] for s in slot_of],
                [dtypes[s] for s in slot_of],
            ),
            slot_of,
        )

    def entries(self, stamps: list[int]) -> Entries:
        """These entries, at the times ``stamps``."""
        return Entries.of_columns(*self.columns, stamps, key=self.token)

    def histogram_rows(
        self, slots: frozenset[int], focus: frozenset[int]
    ) -> tuple[list[int], EntryStructure | None]:
        """The entries of focus layers whose slot is one of ``slots`` (those with a histogram),
        and their structure (None when there are none)."""
        cached = self._histograms
        if cached is not None and cached[0] == slots and cached[1] == focus:
            return cached[2], cached[3]
        rows = [
            i
            for i, (layer, slot) in enumerate(zip(self.columns[0], self.slot_of, strict=True))
            if slot in slots and layer in focus
        ]
        picked = None
        if rows:
            layer, call_index, path, train, grad_enabled, shape, dtype = self.columns
            picked = EntryStructure(
                (
                    [layer[i] for i in rows],
                    [call_index[i] for i in rows],
                    [path[i] for i in rows],
                    [train[i] for i in rows],
                    [grad_enabled[i] for i in rows],
                    [shape[i] for i in rows],
                    [dtype[i] for i in rows],
                ),
                [self.slot_of[i] for i in rows],
            )
        self._histograms = (slots, focus, rows, picked)
        return rows, picked


class StructureMemo:
    """The entry structures of an observer's recent batches, found again by equal rows.

    A training loop records the same layers, calls, paths, modes, shapes and dtypes sample after
    sample; comparing a batch's row lists with a remembered batch's is one C-level pass, where
    building the columns again (and the record batches' key of them) is a Python pass per entry.
    Shared by the threads that finish batches.
    """

    _MAX = 16

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recent: dict[tuple[object, ...], tuple[tuple[list[Any], ...], EntryStructure]] = {}

    def structure(
        self,
        fingerprint: tuple[object, ...],
        compared: tuple[list[Any], ...],
        rows: Callable[[], Sequence[Row]],
        shapes: list[tuple[int, ...]],
        dtypes: list[str],
    ) -> EntryStructure:
        """The structure remembered under ``fingerprint`` if it was built from lists equal to
        ``compared``; else a new one, built from ``rows()``, that replaces it."""
        with self._lock:
            found = self._recent.get(fingerprint)
        if found is not None and found[0] == compared:
            return found[1]
        built = EntryStructure.of_rows(rows(), shapes, dtypes)
        kept = tuple(list(c) for c in compared)
        with self._lock:
            if fingerprint not in self._recent and len(self._recent) >= self._MAX:
                self._recent.pop(next(iter(self._recent)))
            self._recent[fingerprint] = (kept, built)
        return built


class TensorBatch:
    """Collects one sample's tensors of one signal and reduces them in as few calls as possible.

    Snapshots (``detach().clone()``) are taken at the module boundary so later in-place ops
    cannot change what is measured; a tensor that does not fit the budget is reduced at once.
    The same tensor object seen again unchanged (same version: e.g. through ``nn.Identity``
    chains or a parent returning its child's output) is measured once and its row repeated:
    each distinct tensor is a *slot*, each entry (a :data:`Row`) points at one.

    A gradient batch's entries are derived: they take layer, call, path and context from the
    forward entries they answer (:meth:`add_derived`). :meth:`finish` turns the rows into the
    columns the records are built from (:class:`~ti_core.entries.Entries`), on the thread that
    emits the signal (the emission worker, when it runs).
    """

    def __init__(
        self,
        plan: ReductionPlan,
        focus: frozenset[int],
        bins: int = DEFAULT_BINS,
        pool: SnapshotPool | None = None,
        memo: StructureMemo | None = None,
    ):
        self._plan = plan
        self._memo = memo if memo is not None else StructureMemo()
        # Recycled snapshot buffers, only when no user code (a custom reducer) sees them.
        self._pool = pool if plan.default_only else None
        self._pooled: list[torch.Tensor] = []
        self._focus = focus
        self._bins = bins
        self._n_metrics = len(plan.metric_names)
        self.rows: list[Row] = []
        """Entries added with :meth:`add`, in order (complete once the signal ends)."""
        self.stamps: list[int] = []
        """The time of each of :attr:`rows` (microseconds since the epoch)."""
        self._slot_focus: list[bool] = []
        self._slot_shape: list[tuple[int, ...]] = []
        self._slot_dtype: list[str] = []
        # derived entries (gradients): picks into the forward rows, each with slot and time
        self._source: list[Row] | None = None
        self._picks: list[int] = []
        self._pick_slot: list[int] = []
        self._pick_stamp: list[int] = []
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}
        self._bytes = 0
        # Ownership: the slots' tensors, once snapshotted, belong to the reduction.
        self._reduction = SlotReduction(plan, bins, self._slot_focus, self._recycle_snapshots)
        self.host_only = True
        """Every tensor added so far lives in host memory (the emission worker may reduce it)."""

    def __len__(self) -> int:
        return len(self.rows) + len(self._picks)

    @property
    def pending_bytes(self) -> int:
        """Bytes of the snapshots waiting for :meth:`finish`."""
        return self._bytes

    def add(
        self,
        tensor: torch.Tensor,
        layer: int,
        call_index: int,
        path: str,
        train: bool,
        grad_enabled: bool,
        timestamp_us: int,
    ) -> int:
        """Record one entry measuring ``tensor`` (it becomes ``rows[-1]``); returns its slot."""
        # the unchanged-tensor test of _slot, inlined: it runs for every module call
        seen = self._seen.get(id(tensor))
        if seen is not None and seen[0]() is tensor and seen[1] == tensor_version(tensor):
            slot = seen[2]
            if layer in self._focus:
                self._slot_focus[slot] = True
        else:
            slot = self._slot(tensor, layer in self._focus)
        self.rows.append((layer, call_index, path, train, grad_enabled, slot))
        self.stamps.append(timestamp_us)
        return slot

    def entry(self, row: int) -> Entry:
        """Entry ``row`` of :attr:`rows`, whole (for the rare rows that need one alone)."""
        layer, call_index, path, train, grad_enabled, slot = self.rows[row]
        return Entry(
            layer,
            call_index,
            path,
            train,
            grad_enabled,
            self._slot_shape[slot],
            self._slot_dtype[slot],
            self.stamps[row],
        )

    def add_derived(
        self, tensor: torch.Tensor, source: list[Row], picks: list[int], timestamp_us: int
    ) -> None:
        """Record one entry per ``picks`` of ``source`` (a sample's forward rows), each
        measuring ``tensor`` (their output gradient) with its own shape, dtype and time."""
        if self._source is None:
            self._source = source
        elif self._source is not source:  # pragma: no cover - one gradient state, one source
            raise ValueError("a batch derives entries from one source")
        focus = self._focus
        reason = None
        if type(tensor) is not torch.Tensor and is_sharded(tensor):
            # the rows take their path, placements included, from the output they answer
            expected = source[picks[0]][2]
            got = placements_suffix(tensor)
            if not expected.endswith(got):
                placed = expected[expected.rfind("@") + 1 :] if "@" in expected else "none"
                reason = PLACEMENT_MISMATCH_REASON.format(gradient=got[1:], output=placed)
        slot = self._slot(tensor, any(source[r][0] in focus for r in picks), reason)
        self._picks += picks
        self._pick_slot += [slot] * len(picks)
        self._pick_stamp += [timestamp_us] * len(picks)

    def _slot(self, tensor: torch.Tensor, focus: bool, reason: str | None = None) -> int:
        """The slot of ``tensor``: the same unchanged tensor seen before, or a new snapshot
        (or, for a tensor that is not plain, a slot without one and with the ``reason`` it is
        not measured, :func:`~ti_core.reduction.sharding.measurable`)."""
        key = id(tensor)
        version = tensor_version(tensor)
        seen = self._seen.get(key)
        if seen is not None and version is not None and seen[1] == version and seen[0]() is tensor:
            slot = seen[2]
            if focus:
                self._slot_focus[slot] = True
            return slot
        if type(tensor) is torch.Tensor and not tensor.is_nested:
            t = tensor.detach()
        else:
            t, not_measured = measurable(tensor)
            reason = reason or not_measured
            if reason is not None:
                return self._unavailable_slot(t, key, version, tensor, reason)
        if t.device.type != "cpu":
            self.host_only = False
        nbytes = t.numel() * t.element_size()
        fits = not placement.reduce_at_once(self._bytes, nbytes)
        if not fits:
            snap = t
        elif self._pool is not None and SnapshotPool.poolable(t):
            snap = self._pool.copy(t)
            self._pooled.append(snap)
        else:
            snap = t.clone()
        slot = len(self._slot_focus)
        self._slot_focus.append(focus)
        self._slot_shape.append(tuple(t.shape))
        self._slot_dtype.append(dtype_name(t.dtype))
        if version is not None:
            self._seen[key] = (weakref.ref(tensor), version, slot)
        reduction = self._reduction
        reduction.pending.append(snap)
        reduction.pending_slots.append(slot)
        if fits:
            self._bytes += nbytes
        else:
            self._reduce_pending(parallel=placement.share_at_once())
        return slot

    def _unavailable_slot(
        self, t: torch.Tensor, key: int, version: int | None, tensor: torch.Tensor, reason: str
    ) -> int:
        """A slot for ``tensor``, which is not measured (``reason``): its rows are null."""
        slot = self._given_slot(shape_of(t), dtype_name(t.dtype), {}, reason)
        if version is not None:
            self._seen[key] = (weakref.ref(tensor), version, slot)
        return slot

    def _given_slot(
        self, shape: tuple[int, ...], dtype: str, values: dict[str, float], reason: str
    ) -> int:
        """A slot measured without a snapshot (no histogram): ``values`` by metric name, the
        other metrics null with ``reason``."""
        slot = len(self._slot_focus)
        self._slot_focus.append(False)
        self._slot_shape.append(shape)
        self._slot_dtype.append(dtype)
        self._reduction.given(slot, values, self._plan.metric_names, reason)
        return slot

    def renumber(self, row: int, call_index: int) -> None:
        """Give entry ``row`` of :attr:`rows` the call index ``call_index`` (a call signal's
        entries, recorded as their call started, take the index of the call's output)."""
        layer, _, path, train, grad_enabled, slot = self.rows[row]
        self.rows[row] = (layer, call_index, path, train, grad_enabled, slot)

    def discard(self, rows: Iterable[int]) -> None:
        """Drop the entries ``rows`` of :attr:`rows` (their snapshots are still reduced, and
        not written): a call signal's entries of a call that never returned."""
        for row in sorted(set(rows), reverse=True):
            del self.rows[row]
            del self.stamps[row]

    def add_measured(
        self,
        values: dict[str, float],
        reason: str,
        shape: tuple[int, ...],
        dtype: str,
        entry: tuple[int, int, str, bool, bool, int],
    ) -> None:
        """Record one entry whose tensor was measured elsewhere (in blocks, never whole):
        ``values`` by metric name, the other metrics null with ``reason``; ``entry`` is
        ``(layer, call_index, path, train, grad_enabled, timestamp_us)``."""
        layer, call_index, path, train, grad_enabled, stamp = entry
        slot = self._given_slot(shape, dtype, values, reason)
        self.rows.append((layer, call_index, path, train, grad_enabled, slot))
        self.stamps.append(stamp)

    def _reduce_pending(self, parallel: bool = False) -> None:
        self._bytes = 0
        self._reduction.reduce_pending(parallel)

    def _recycle_snapshots(self) -> None:
        if self._pool is not None and self._pooled:
            # every pooled snapshot was pending, and is now reduced: nothing reads it again
            self._pool.recycle(self._pooled)
            self._pooled = []

    def _entries(self) -> tuple[Entries, EntryStructure | None]:
        """The entries as columns, and their structure (derived ones resolved)."""
        shapes, dtypes = self._slot_shape, self._slot_dtype
        if self._source is not None and self._picks:
            source, picks, slots = self._source, self._picks, self._pick_slot
            structure = self._memo.structure(
                (True, len(picks), picks[0], len(shapes)),
                (source, picks, slots, shapes, dtypes),
                lambda: [(*source[r][:5], s) for r, s in zip(picks, slots, strict=True)],
                shapes,
                dtypes,
            )
            stamps = self._pick_stamp
        elif self.rows:
            rows = self.rows
            structure = self._memo.structure(
                (False, len(rows), rows[0], len(shapes)),
                (rows, shapes, dtypes),
                lambda: rows,
                shapes,
                dtypes,
            )
            stamps = self.stamps
        else:
            return Entries(), None
        return structure.entries(stamps), structure

    def finish(self) -> Reduced:
        """Reduce what is pending and return every measurement in entry order."""
        self._reduce_pending()
        self._seen.clear()
        entries, structure = self._entries()
        m = self._n_metrics
        reduction = self._reduction
        if structure is None:
            return Reduced(
                entries, np.empty((0, m)), np.empty((0, m), np.bool_), [], reduction.errors
            )
        values, available, reasons = reduction.rows(structure.slot_of, len(self._slot_focus))
        reduced = Reduced(entries, values, available, reasons, reduction.errors)
        if reduction.histograms:
            hist_rows, picked = structure.histogram_rows(
                frozenset(reduction.histograms), self._focus
            )
            if picked is not None:
                reduced.histograms = reduction.histogram_matrix(picked.slot_of)
                stamps = entries.timestamp_us
                reduced.histogram_entries = picked.entries([stamps[i] for i in hist_rows])
        return reduced


__all__ = [
    "EntryStructure",
    "Reduced",
    "Row",
    "StructureMemo",
    "TensorBatch",
    "tensor_version",
]
