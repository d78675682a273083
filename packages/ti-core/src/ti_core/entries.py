"""The identity and context of measured tensors, as capture records them: :class:`Entry` (one
tensor), :class:`Entries` (many, one list per field: what the record batches are built from),
:class:`Gaps` (tensors without a value, and why).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import itemgetter


@dataclass(frozen=True, slots=True)
class Entry:
    """Identity and context of one measured tensor."""

    layer: int
    """Index into the run's layers."""
    call_index: int
    path: str
    train: bool
    grad_enabled: bool
    shape: tuple[int, ...]
    dtype: str
    timestamp_us: int


class Entries:
    """Identity and context of measured tensors, one list per :class:`Entry` field.

    What the record batches are built from: column ``f`` of row ``i`` is field ``f`` of the
    ``i``-th measured tensor. Capture records rows (``ti_core.reduction.batch.Row``) and turns
    them into columns once per signal.
    """

    __slots__ = (
        "call_index",
        "dtype",
        "grad_enabled",
        "key",
        "layer",
        "path",
        "shape",
        "timestamp_us",
        "train",
    )

    def __init__(self) -> None:
        self.layer: list[int] = []
        self.call_index: list[int] = []
        self.path: list[str] = []
        self.train: list[bool] = []
        self.grad_enabled: list[bool] = []
        self.shape: list[tuple[int, ...]] = []
        self.dtype: list[str] = []
        self.timestamp_us: list[int] = []
        self.key: int | None = None
        """Equal for entries whose columns, all but ``timestamp_us``, are equal (None: not
        known). Capture sets it where it reuses the columns of an earlier batch, and the record
        batches then reuse the identity columns built for that key."""

    def __len__(self) -> int:
        return len(self.layer)

    def __getitem__(self, i: int) -> Entry:
        return Entry(
            self.layer[i],
            self.call_index[i],
            self.path[i],
            self.train[i],
            self.grad_enabled[i],
            self.shape[i],
            self.dtype[i],
            self.timestamp_us[i],
        )

    @classmethod
    def of_columns(
        cls,
        layer: list[int],
        call_index: list[int],
        path: list[str],
        train: list[bool],
        grad_enabled: list[bool],
        shape: list[tuple[int, ...]],
        dtype: list[str],
        timestamp_us: list[int],
        key: int | None = None,
    ) -> Entries:
        """Entries from equally long columns (taken, not copied; columns shared under a ``key``
        are never changed)."""
        lengths = {len(c) for c in (layer, call_index, path, train, grad_enabled, shape, dtype)}
        if lengths != {len(timestamp_us)}:
            raise ValueError(f"entry columns differ in length: {sorted(lengths)}")
        out = cls()
        out.layer, out.call_index, out.path, out.train = layer, call_index, path, train
        out.grad_enabled, out.shape, out.dtype = grad_enabled, shape, dtype
        out.timestamp_us = timestamp_us
        out.key = key
        return out

    @classmethod
    def of(cls, entries: Iterable[Entry]) -> Entries:
        """The columns of ``entries``."""
        out = cls()
        for e in entries:
            out.append(e)
        return out

    def append(self, e: Entry) -> None:
        """Add ``e`` as the last row."""
        self.layer.append(e.layer)
        self.call_index.append(e.call_index)
        self.path.append(e.path)
        self.train.append(e.train)
        self.grad_enabled.append(e.grad_enabled)
        self.shape.append(e.shape)
        self.dtype.append(e.dtype)
        self.timestamp_us.append(e.timestamp_us)

    def take(self, rows: Sequence[int]) -> Entries:
        """The entries at ``rows``, in that order."""
        out = Entries()
        if not rows:
            return out
        get = itemgetter(*rows)
        for name in _COLUMNS:
            picked = get(getattr(self, name))
            setattr(out, name, list(picked) if len(rows) > 1 else [picked])
        return out


_COLUMNS = tuple(name for name in Entries.__slots__ if name != "key")


class Gaps:
    """Tensors without a value in a signal (an output whose gradient cannot be captured, a
    parameter whose update was not measured): their entries and the reason for each."""

    __slots__ = ("entries", "reasons")

    def __init__(self) -> None:
        self.entries = Entries()
        self.reasons: list[str] = []

    def __len__(self) -> int:
        return len(self.reasons)

    def add(self, entry: Entry, reason: str) -> None:
        """``entry`` has no capturable gradient, because ``reason``."""
        self.entries.append(entry)
        self.reasons.append(reason)

    @classmethod
    def of(cls, pairs: Iterable[tuple[Entry, str]]) -> Gaps:
        """``(entry, reason)`` pairs (the parameter signals' gaps) as gaps."""
        gaps = cls()
        for entry, reason in pairs:
            gaps.add(entry, reason)
        return gaps


def as_entries(entries: Entries | Sequence[Entry]) -> Entries:
    """``entries`` as columns (a sequence of :class:`Entry` is converted)."""
    return entries if isinstance(entries, Entries) else Entries.of(entries)


__all__ = ["Entries", "Entry", "Gaps", "as_entries"]
