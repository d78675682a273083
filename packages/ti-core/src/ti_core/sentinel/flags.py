"""Non-finite flags of one check (a root forward's outputs, or the gradients one backward
delivered to it), exact, and read once per check.

A plain CPU tensor is checked at once (:func:`cpu_nonfinite`): its sum (from 32,768
contiguous float32/float64 entries on, its dot product with itself, which runs as one BLAS
call instead of on torch's intra-op threads) is finite whenever the tensor is (NaN and
infinities propagate), so a finite sum, one read of the tensor and one scalar read, clears it;
a non-finite sum (a NaN or an infinity, or finite entries whose sum overflowed) is decided
exactly by ``aminmax``. Only a flagged tensor is remembered.

Elsewhere (an accelerator, a tensor subclass) a :class:`Flags` collects two 0-d tensors per
checked tensor (:func:`flag_values`, ``aminmax``'s two), on the tensor's device, with no host
synchronization: they are all finite exactly when the tensor is, so the check is exact and
cannot overflow. A compiled graph hands it one 0-d bool per tensor instead, true when the
tensor is finite (:meth:`Flags.add_value`). :meth:`Flags.read` reads CPU values directly;
values on an accelerator are stacked per device into one flag each, and only a set flag makes
it read which fired. There the read is asynchronous (:class:`PendingRead`): the
flag is copied to the host behind a CUDA event, and the caller acts on it at the next check,
one root forward later.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from math import isfinite
from typing import Final

import torch
from torch import Tensor

from ti_core import _torch
from ti_core.compiled.slots import Flagged, can_be_nonfinite, real_view
from ti_core.reduction.sharding import is_sharded, local_tensor

_STRIDED: Final = torch.strided
_HALF: Final[frozenset[torch.dtype]] = frozenset({torch.float16, torch.bfloat16})
"""Summed in float32 (a float16 sum of ordinary values overflows its 65,504)."""
_BLAS: Final[frozenset[torch.dtype]] = frozenset({torch.float32, torch.float64})
"""Checked by a BLAS ``dot`` from :data:`_PARALLEL` entries on."""
_PARALLEL: Final = 32_768
"""ATen's grain size: a CPU reduction of this many entries or more runs on its threads."""
_THREADED: Final = 1 << 20
"""From this many entries on, :func:`plain_total` sums on torch's intra-op threads again: a
tensor this large is read from memory, where two threads read faster than one BLAS ``dot``
(a GPT-2 small backward's parameter gradients: 16 against 20 ms, benchmarks/README.md)."""


def real_values(tensor: Tensor) -> Tensor | None:
    """A detached real view of ``tensor``'s entries that aminmax and sum take
    (:func:`~ti_core.compiled.slots.real_view`: complex as real pairs, float8 and other
    narrow formats widened to float32); None when it cannot hold a non-finite value
    (integers, booleans, no entries) or is not a dense tensor."""
    if type(tensor) is not Tensor and is_sharded(tensor):
        # this rank's part, read without a collective (a DTensor's own reductions issue one)
        tensor = local_tensor(tensor)
    if tensor.layout is not _STRIDED or not tensor.numel():
        return None
    if not can_be_nonfinite(tensor.dtype):
        return None
    # ``.data`` of a plain tensor: a detached alias without ``detach()``'s autograd bookkeeping
    return real_view(tensor.data if type(tensor) is Tensor else tensor.detach())


def flag_values(tensor: Tensor) -> tuple[Tensor, ...]:
    """0-d tensors on ``tensor``'s device, all finite exactly when every entry of ``tensor``
    is; empty when it cannot hold a non-finite value (integers, booleans, no entries) or is
    not a plain dense tensor.

    They are ``aminmax``'s two (NaN propagates to both, +inf is the max, -inf the min): one
    read of the tensor, which cannot overflow. (A dot product with a vector of zeros, tried
    for CPU tensors, costs about twice as much inside a training step as alone: its second
    operand evicts the step's own data from the cache.)
    """
    values = real_values(tensor)
    return () if values is None else tuple(torch.aminmax(values))


def cpu_nonfinite(tensor: Tensor) -> bool | None:
    """Whether the plain (``type(t) is Tensor``) CPU tensor holds a NaN or an infinity; None
    when it cannot (integers, booleans, no entries, not dense). Exact: a finite sum clears it,
    a non-finite one is decided by ``aminmax`` (finite entries can overflow a sum).

    From :data:`_PARALLEL` entries on, a contiguous float32/float64 tensor is summed as its dot
    product with itself (finite whenever the tensor is, as a sum is): torch runs a reduction
    that large on its intra-op threads, which inside a training step costs more than the read
    (about 13 against 7 us at 32,768 entries, between two matrix products on two threads),
    while the BLAS ``dot`` stays fast at every size from there on (benchmarks/README.md)."""
    values = real_values(tensor)
    if values is None:
        return None
    dtype = values.dtype
    if dtype in _BLAS and values.numel() >= _PARALLEL and values.is_contiguous():
        flat = values.view(-1)
        total = torch.dot(flat, flat)
    else:
        total = values.sum(dtype=torch.float32) if dtype in _HALF else values.sum()
    if isfinite(total.item()):
        return False
    low, high = torch.aminmax(values)
    return not (isfinite(low.item()) and isfinite(high.item()))


def plain_total(tensor: Tensor) -> float | None:
    """For a plain (``type(t) is Tensor``) contiguous float32/float64 CPU tensor, a number that
    is finite whenever every entry is: its sum (from :data:`_PARALLEL` entries on, its dot
    product with itself, as in :func:`cpu_nonfinite`); None for any other tensor.

    The replay mode's checks add these up over every tensor of one check and read them with no
    more Python per tensor than the reduction: a finite total clears them all; only a total
    that is not (a non-finite entry, or finite ones that overflowed) is decided exactly, tensor
    by tensor (:class:`Flags`)."""
    if type(tensor) is not Tensor or not tensor.is_cpu or tensor.dtype not in _BLAS:
        return None
    if not tensor.is_contiguous():
        return None
    values = tensor.data
    count = values.numel()
    if _PARALLEL <= count < _THREADED:
        flat = values.view(-1)
        return float(torch.dot(flat, flat).item())
    return float(values.sum().item())


def check_all(entries: Iterable[tuple[int, str, Tensor]]) -> Flagged | PendingRead:
    """One check over ``(layer, path, tensor)`` entries: the flagged ones (an empty list:
    clean), or a :class:`PendingRead` when any lives on an accelerator. Plain CPU tensors are
    cleared together by :func:`plain_total`; every other tensor, and all of them when that
    total is not finite, goes through :class:`Flags`."""
    total = 0.0
    rest: list[tuple[int, str, Tensor]] = []
    fused: dict[tuple[torch.device, torch.dtype], list[tuple[int, str, Tensor]]] = {}
    every = list(entries)
    for entry in every:
        tensor = entry[2]
        value = plain_total(tensor)
        if value is not None:
            total += value
        elif type(tensor) is Tensor and not tensor.is_cpu and tensor.layout is _STRIDED:
            fused.setdefault((tensor.device, tensor.dtype), []).append(entry)
        else:
            rest.append(entry)
    if not isfinite(total):
        rest, fused = every, {}  # decided exactly, tensor by tensor
    if not rest and not fused:
        return []
    flags = Flags()
    for group in fused.values():
        flags.add_norms(group)
    for layer, path, tensor in rest:
        flags.add(layer, path, tensor)
    return flags.read()


class Flags:
    """The flags of one check (a root forward's outputs, or one backward's gradients)."""

    __slots__ = (
        "accelerated",
        "entries",
        "flagged",
        "keys",
        "orders",
        "owners",
        "sources",
        "values",
    )

    def __init__(self) -> None:
        self.entries: list[tuple[int, str]] = []
        """``(layer, tensor_path)`` of each tensor flagged already or with values to read."""
        self.flagged: list[int] = []
        """The entries known to be flagged (plain CPU tensors, checked at once)."""
        self.values: list[Tensor] = []
        self.owners: list[int] = []
        """The entry each value belongs to."""
        self.accelerated = False
        """Whether any value lives off the CPU (then :meth:`read` is asynchronous)."""
        self.orders: dict[int, int | Tensor] = {}
        """Per entry of a compiled graph's operator, the slots' counter when it was checked
        (:mod:`~ti_core.compiled.slots`): where it falls among the slots' flags."""
        self.keys: list[float] = []
        """Per entry of the last read's result, that order (infinity: none, after the slots)."""
        self.sources: dict[int, Tensor] = {}
        """Entries checked by a norm (:meth:`add_norms`): the tensor, checked exactly when its
        norm is not finite (finite entries can overflow a norm)."""

    def add(self, layer: int, path: str, tensor: Tensor) -> None:
        """Check one tensor: a plain CPU one at once, others queued on their device."""
        if type(tensor) is Tensor and tensor.is_cpu:
            if cpu_nonfinite(tensor):
                self._flag(layer, path)
            return
        found = flag_values(tensor)
        if found:
            entry = len(self.entries)
            self.entries.append((layer, path))
            for value in found:
                self.values.append(value)
                self.owners.append(entry)
            if not tensor.is_cpu:
                self.accelerated = True

    def add_norms(self, entries: list[tuple[int, str, Tensor]]) -> None:
        """Check tensors of one device and dtype with one fused reduction: their L2 norms by
        ``torch._foreach_norm`` (one multi-tensor kernel on an accelerator; half precision
        accumulated in float32), each finite whenever its tensor is. A norm that is not is
        decided exactly when read (finite entries whose squares overflowed are not flagged)."""
        kept = [
            (entry, values) for entry in entries if (values := real_values(entry[2])) is not None
        ]
        if not kept:
            return
        dtype = torch.float32 if kept[0][1].dtype in _HALF else None
        norms = _torch.foreach_norm([values for _, values in kept], 2.0, dtype)
        for ((layer, path, _), values), norm in zip(kept, norms, strict=True):
            entry = len(self.entries)
            self.entries.append((layer, path))
            self.values.append(norm)
            self.owners.append(entry)
            self.sources[entry] = values
            if not values.is_cpu:
                self.accelerated = True

    def add_value(self, layer: int, path: str, finite: Tensor, order: Tensor | None = None) -> None:
        """A compiled graph's check of one tensor (a 0-d bool, true when every entry is
        finite); ``order``: the slots' counter at that check (a 0-d or one-element tensor),
        or None.

        Both live in the graph's buffers, which the compiler reuses for later results once
        the operator that received them returns: they are read now on the CPU, and copied
        into tensors of the recorder's own on an accelerator (the copies run before any later
        kernel of the stream can overwrite them)."""
        if finite.is_cpu:
            if not finite.item():
                self._flag(layer, path, None if order is None else int(order.item()))
            return
        entry = len(self.entries)
        self.entries.append((layer, path))
        self.values.append(torch.where(finite, 0.0, math.inf))  # a copy, finite when clean
        self.owners.append(entry)
        if order is not None:
            self.orders[entry] = order.clone()
        self.accelerated = True

    def _flag(self, layer: int, path: str, order: int | None = None) -> None:
        """Record a tensor known to be flagged."""
        if order is not None:
            self.orders[len(self.entries)] = order
        self.flagged.append(len(self.entries))
        self.entries.append((layer, path))

    def read(self) -> Flagged | PendingRead:
        """The flagged entries (an empty list: clean), or, when any value lives on an
        accelerator, a :class:`PendingRead` to ask later."""
        values = self.values
        if not self.accelerated:  # CPU scalars: reading each is cheaper than one more kernel
            if not values and not self.flagged:
                return []  # (every forward of a compiled run, whose checks wrote slots)
            return self._flagged([p for p, v in enumerate(values) if not isfinite(v.item())])
        groups: dict[torch.device, list[int]] = {}
        for position, value in enumerate(values):
            groups.setdefault(value.device, []).append(position)
        return PendingRead(self, groups)

    def _flagged(self, positions: Iterable[int]) -> Flagged:
        entries = sorted({self.owners[p] for p in positions}.union(self.flagged))
        sources = self.sources
        if sources:  # a norm that overflowed on finite entries flags nothing
            entries = [e for e in entries if e not in sources or _exactly_nonfinite(sources[e])]
        orders = self.orders
        self.keys = [_key(orders.get(e)) for e in entries]
        return [self.entries[e] for e in entries]


def _exactly_nonfinite(values: Tensor) -> bool:
    low, high = torch.aminmax(values)
    return not (isfinite(low.item()) and isfinite(high.item()))


def _key(order: int | Tensor | None) -> float:
    if order is None:
        return math.inf
    return float(order if isinstance(order, int) else order.item())


class PendingRead:
    """A flag read in flight from an accelerator: :meth:`ready` without waiting, then
    :meth:`result`."""

    __slots__ = ("_events", "_flags", "_host", "_stacked")

    def __init__(self, flags: Flags, groups: dict[torch.device, list[int]]) -> None:
        self._flags = flags
        self._stacked: list[tuple[list[int], Tensor]] = []
        self._host: list[Tensor] = []
        self._events: list[object] = []
        for positions in groups.values():
            stacked = torch.isfinite(torch.stack([flags.values[p] for p in positions]))
            self._stacked.append((positions, stacked))
            self._host.append(stacked.all().to("cpu", non_blocking=True))
            device = stacked.device
            if device.type == "cuda":
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(torch.cuda.current_stream(device))
                self._events.append(event)

    def ready(self) -> bool:
        """Whether every device has delivered its flag (never waits)."""
        return all(bool(event.query()) for event in self._events)  # type: ignore[attr-defined]

    def result(self) -> Flagged:
        """The flagged entries (waits for the copies; reads the details only when flagged)."""
        for event in self._events:
            event.synchronize()  # type: ignore[attr-defined]
        bad: list[int] = []
        for (positions, finite), host in zip(self._stacked, self._host, strict=True):
            if bool(host):
                continue
            bad.extend(positions[i] for i in (~finite).nonzero().flatten().tolist())
        return self._flags._flagged(bad)


__all__ = [
    "Flagged",
    "Flags",
    "PendingRead",
    "check_all",
    "cpu_nonfinite",
    "flag_values",
    "plain_total",
    "real_values",
]
