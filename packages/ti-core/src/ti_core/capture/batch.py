"""One sample's tensors of one signal: snapshots at the module boundary, reduced in batches.

Ownership: a :class:`TensorBatch` is filled by the thread that captures (a sampled forward, or a
backward delivering gradients) and finished once, by whoever emits the signal (that thread, or
the emission worker). It holds snapshots, never the live tensors it was given, except a tensor
too big for :data:`SNAPSHOT_BUDGET_BYTES`, which is reduced at once, in place.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import torch

from ti_core.capture.snapshots import SnapshotPool
from ti_core.records import Entry
from ti_core.reduction.histograms import DEFAULT_BINS, HistogramData, compute_histograms
from ti_core.reduction.plan import ReductionPlan

SNAPSHOT_BUDGET_BYTES: Final[int] = 64 * 2**20
"""Tensors are cloned for a batched reduction until a batch holds this much; beyond it, pending
tensors are reduced at once (a bigger tensor is reduced in place, without a copy). Also the
emission worker's bound on the snapshot bytes it holds queued."""


def tensor_version(tensor: torch.Tensor) -> int | None:
    """The version counter of ``tensor`` (bumped by in-place writes); None for inference tensors."""
    try:
        return int(tensor._version)
    except RuntimeError:  # inference tensors have no version counter
        return None


@dataclass
class Reduced:
    """Measurements of a batch of entries, aligned with ``entries``."""

    entries: list[Entry]
    values: np.ndarray
    available: np.ndarray
    reasons: list[list[str | None]]
    errors: list[BaseException]
    histogram_entries: list[Entry] = field(default_factory=list)
    histograms: list[HistogramData] = field(default_factory=list)


class TensorBatch:
    """Collects one sample's tensors of one signal and reduces them in as few calls as possible.

    Snapshots (``detach().clone()``) are taken at the module boundary so later in-place ops
    cannot change what is measured; a tensor that does not fit the budget is reduced at once.
    The same tensor object seen again unchanged (same version: e.g. through ``nn.Identity``
    chains or a parent returning its child's output) is measured once and its row repeated.
    """

    def __init__(
        self,
        plan: ReductionPlan,
        focus: frozenset[int],
        bins: int = DEFAULT_BINS,
        pool: SnapshotPool | None = None,
    ):
        self._plan = plan
        # Recycled snapshot buffers, only when no user code (a custom reducer) sees them.
        self._pool = pool if plan.default_only else None
        self._pooled: list[torch.Tensor] = []
        self._focus = focus
        self._bins = bins
        self._n_metrics = len(plan.metric_names)
        self.entries: list[Entry] = []
        self._slot_of: list[int] = []
        self._slot_focus: list[bool] = []
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}
        self._pending: list[torch.Tensor] = []
        self._pending_slots: list[int] = []
        self._bytes = 0
        self._values: list[np.ndarray] = []
        self._available: list[np.ndarray] = []
        self._reasons: list[list[str | None]] = []
        self._reduced_slots: list[int] = []
        self._errors: list[BaseException] = []
        self._hist: dict[int, HistogramData] = {}
        self.host_only = True
        """Every tensor added so far lives in host memory (the emission worker may reduce it)."""

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def pending_bytes(self) -> int:
        """Bytes of the snapshots waiting for :meth:`finish`."""
        return self._bytes

    def add(self, entry: Entry, tensor: torch.Tensor) -> None:
        key = id(tensor)
        version = tensor_version(tensor)
        seen = self._seen.get(key)
        focus = entry.layer in self._focus
        if seen is not None and version is not None and seen[1] == version and seen[0]() is tensor:
            slot = seen[2]
            if focus:
                self._slot_focus[slot] = True
        else:
            t = tensor.detach()
            if t.device.type != "cpu":
                self.host_only = False
            nbytes = t.numel() * t.element_size()
            fits = self._bytes + nbytes <= SNAPSHOT_BUDGET_BYTES
            if not fits:
                snap = t
            elif self._pool is not None and SnapshotPool.poolable(t):
                snap = self._pool.copy(t)
                self._pooled.append(snap)
            else:
                snap = t.clone()
            slot = len(self._slot_focus)
            self._slot_focus.append(focus)
            if version is not None:
                self._seen[key] = (weakref.ref(tensor), version, slot)
            self._pending.append(snap)
            self._pending_slots.append(slot)
            if fits:
                self._bytes += nbytes
            else:
                self._reduce_pending()
        self.entries.append(entry)
        self._slot_of.append(slot)

    def _reduce_pending(self) -> None:
        if not self._pending:
            return
        tensors, slots = self._pending, self._pending_slots
        self._pending, self._pending_slots, self._bytes = [], [], 0
        n, m = len(tensors), self._n_metrics
        try:
            got = self._plan.reduce(tensors)
            values = np.asarray(got.values, dtype=np.float64).reshape(n, m)
            available = np.asarray(got.available, dtype=np.bool_).reshape(n, m)
            reasons = [list(r) for r in got.reasons]
            self._errors.extend(got.errors)
            ordered, moments = got.ordered, got.moments
        except Exception as error:  # reducers promise not to raise; keep the rows if they do
            values = np.full((n, m), np.nan)
            available = np.zeros((n, m), dtype=np.bool_)
            reason = f"reduction failed: {type(error).__name__}: {error}"
            reasons = [[reason] * m for _ in range(n)]
            ordered, moments = {}, {}
            self._errors.append(error)
        self._values.append(values)
        self._available.append(available)
        self._reasons.extend(reasons)
        self._reduced_slots.extend(slots)
        focus = [
            (s, t, ordered.get(k), moments.get(k))
            for k, (s, t) in enumerate(zip(slots, tensors, strict=True))
            if self._slot_focus[s]
        ]
        if focus:
            try:
                hists = compute_histograms(
                    [t for _, t, _, _ in focus],
                    bins=self._bins,
                    ordered=[o for _, _, o, _ in focus],
                    moments=[known for _, _, _, known in focus],
                )
                self._hist.update((s, h) for (s, _, _, _), h in zip(focus, hists, strict=True))
            except Exception as error:
                self._errors.append(error)
        if self._pool is not None and self._pooled:
            # every pooled snapshot was pending, and is now reduced: nothing reads it again
            self._pool.recycle(self._pooled)
            self._pooled = []

    def finish(self) -> Reduced:
        """Reduce what is pending and return every measurement in entry order."""
        self._reduce_pending()
        self._seen.clear()
        m = self._n_metrics
        if not self.entries:
            return Reduced([], np.empty((0, m)), np.empty((0, m), np.bool_), [], self._errors)
        row_of_slot = np.empty(len(self._slot_focus), dtype=np.int64)
        row_of_slot[np.asarray(self._reduced_slots, dtype=np.int64)] = np.arange(
            len(self._reduced_slots)
        )
        rows = row_of_slot[np.asarray(self._slot_of, dtype=np.int64)]
        values = np.concatenate(self._values)[rows]
        available = np.concatenate(self._available)[rows]
        reasons = [self._reasons[i] for i in rows.tolist()]
        hist_entries: list[Entry] = []
        histograms: list[HistogramData] = []
        if self._hist:
            for entry, slot in zip(self.entries, self._slot_of, strict=True):
                hist = self._hist.get(slot)
                if hist is not None and entry.layer in self._focus:
                    hist_entries.append(entry)
                    histograms.append(hist)
        return Reduced(
            self.entries, values, available, reasons, self._errors, hist_entries, histograms
        )


__all__ = ["SNAPSHOT_BUDGET_BYTES", "Reduced", "TensorBatch", "tensor_version"]
