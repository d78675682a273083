"""The reduction of one signal's distinct tensors (*slots*), in as few plan calls as possible.

Capture (:class:`~ti_core.reduction.batch.TensorBatch`) decides what a slot is (a distinct
tensor, snapshotted at the module boundary) and which entries point at it; this module owns
what happens to the slots' tensors: they wait (:attr:`SlotReduction.pending`) until a snapshot
budget or the end of the signal, are reduced together by the :class:`ReductionPlan` with the
histograms of the focus slots counted from the same pass, and their measurements are handed
back in any entry order (:meth:`SlotReduction.rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import overload

import numpy as np
import torch

from ti_core.reduction.histograms import HistogramRows, histogram_rows
from ti_core.reduction.plan import ReductionPlan


class SlotReduction:
    """Pending slot tensors and the measurements of the reduced ones."""

    def __init__(
        self,
        plan: ReductionPlan,
        bins: int,
        slot_focus: Sequence[bool],
        on_reduced: Callable[[], None] | None = None,
    ) -> None:
        self._plan = plan
        self._bins = bins
        self._slot_focus = slot_focus
        """Whether each slot is a focus tensor (owned by the caller, which appends to it)."""
        self._on_reduced = on_reduced
        """Called after each reduction: every tensor added before it is no longer read."""
        self._n_metrics = len(plan.metric_names)
        self.pending: list[torch.Tensor] = []
        """Tensors waiting for :meth:`reduce_pending` (snapshots, or a tensor itself): the
        caller appends each with its slot in :attr:`pending_slots`, without a call per tensor
        on the capture path."""
        self.pending_slots: list[int] = []
        """The slot of each of :attr:`pending`."""
        self._values: list[np.ndarray] = []
        self._available: list[np.ndarray] = []
        self._reasons: list[list[str | None]] = []
        self._reduced_slots: list[int] = []
        self.errors: list[BaseException] = []
        self.histograms: dict[int, np.ndarray] = {}
        """Histogram row (``ti_core.reduction.layout``) of each reduced focus slot."""

    def reduce_pending(self, parallel: bool = False) -> None:
        """Reduce every queued tensor, and count the histograms of the focus slots."""
        if not self.pending:
            return
        tensors, slots = self.pending, self.pending_slots
        self.pending, self.pending_slots = [], []
        n, m = len(tensors), self._n_metrics
        try:
            got = self._plan.reduce(tensors, parallel=parallel)
            values = np.asarray(got.values, dtype=np.float64).reshape(n, m)
            available = np.asarray(got.available, dtype=np.bool_).reshape(n, m)
            reasons = [list(r) for r in got.reasons]
            self.errors.extend(got.errors)
            ordered, moments = got.ordered, got.moments
        except Exception as error:  # reducers promise not to raise; keep the rows if they do
            values = np.full((n, m), np.nan)
            available = np.zeros((n, m), dtype=np.bool_)
            reason = f"reduction failed: {type(error).__name__}: {error}"
            reasons = [[reason] * m for _ in range(n)]
            ordered, moments = {}, {}
            self.errors.append(error)
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
                hists = histogram_rows(
                    [t for _, t, _, _ in focus],
                    bins=self._bins,
                    ordered=[o for _, _, o, _ in focus],
                    moments=[known for _, _, _, known in focus],
                    trusted=True,
                    parallel=parallel,
                )
                self.histograms.update(
                    (s, row) for (s, _, _, _), row in zip(focus, hists.rows, strict=True)
                )
            except Exception as error:
                self.errors.append(error)
        if self._on_reduced is not None:
            self._on_reduced()

    def given(
        self, slot: int, values: dict[str, float], names: tuple[str, ...], reason: str
    ) -> None:
        """``slot`` was measured elsewhere (in blocks: the attention logits over the budget),
        or not at all (no values: a tensor without a plain representation): its ``values`` by
        metric name; the metrics of ``names`` it lacks are null with ``reason``."""
        row = np.array([values.get(n, np.nan) for n in names], dtype=np.float64)
        available = np.array([n in values and np.isfinite(values[n]) for n in names])
        self._values.append(row[None, :])
        self._available.append(available[None, :])
        self._reasons.append([None if ok else reason for ok in available.tolist()])
        self._reduced_slots.append(slot)

    def rows(
        self, slot_of: Sequence[int], n_slots: int
    ) -> tuple[np.ndarray, np.ndarray, Sequence[list[str | None]]]:
        """Values, availability and reasons of each entry, entry ``i`` measuring slot
        ``slot_of[i]`` (of ``n_slots``, every one reduced)."""
        row_of_slot = np.empty(n_slots, dtype=np.int64)
        row_of_slot[np.asarray(self._reduced_slots, dtype=np.int64)] = np.arange(
            len(self._reduced_slots)
        )
        rows = row_of_slot[np.asarray(slot_of, dtype=np.int64)]
        values = np.concatenate(self._values)[rows]
        available = np.concatenate(self._available)[rows]
        return values, available, _RowReasons(self._reasons, rows)

    def histogram_matrix(self, slots: Sequence[int]) -> HistogramRows:
        """The histogram rows of ``slots`` (focus slots, reduced), in that order."""
        return HistogramRows(np.stack([self.histograms[s] for s in slots]), self._bins)


class _RowReasons(Sequence[list[str | None]]):
    """The reasons of each entry, looked up in the reduced rows only when asked (the record
    batch asks only for entries with a missing value, rarely any)."""

    def __init__(self, by_row: list[list[str | None]], rows: np.ndarray) -> None:
        self._by_row = by_row
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> list[str | None]: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[list[str | None]]: ...
    def __getitem__(self, i: int | slice) -> list[str | None] | Sequence[list[str | None]]:
        if isinstance(i, slice):
            return [self._by_row[r] for r in self._rows[i].tolist()]
        return self._by_row[int(self._rows[i])]


__all__ = ["SlotReduction"]
