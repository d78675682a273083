"""Where, and on which thread, each tensor is reduced: the one place that decides it, and why.

Three decisions, taken at three moments (docs/capture.md, "Where the reduction runs"):

1. **At attach** (:func:`worker_allowed`): may reductions leave the training thread at all?
   Only when nothing the user wrote runs there (the default metrics only: a custom reducer is
   user code), no sink was promised calls on the training thread (every sink declares
   ``SinkCapabilities(background_writes=True)``), and no failure must raise inside the training
   step (``error_policy="raise"``).
2. **As a tensor is captured** (:func:`reduce_at_once`): a signal's tensors are snapshotted
   and wait for the end of their signal, until the snapshots would exceed
   :data:`SNAPSHOT_BUDGET_BYTES`; then what is pending is reduced at once, on the capturing
   thread, and a tensor too big for the budget is reduced in place, without a copy. That pass
   may share the work with one helper thread only where the user let torch use more than one
   intra-op thread (:func:`share_at_once`).
3. **As a signal ends** (:func:`signal_thread`): the emission worker (host tensors, when 1.
   allowed it), or the thread that ended the signal: at once for a small signal while the
   worker is idle (:data:`INLINE_SIGNAL_BYTES`), else once the worker's queue has caught up
   (accelerator tensors, reduced on their device; a full or closed worker), so sinks receive
   signals in the order they ended.

The reduction itself (:meth:`ti_core.reduction.batch.TensorBatch.finish`) is the same work on
either thread: that is what makes rows identical inline and on the worker.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Final

import torch

from ti_core.sink import SinkCapabilities

SNAPSHOT_BUDGET_BYTES: Final[int] = 64 * 2**20
"""Tensors are cloned for a batched reduction until a batch holds this much; beyond it, pending
tensors are reduced at once (a bigger tensor is reduced in place, without a copy). Also the
emission worker's bound on the snapshot bytes it holds queued."""

INLINE_SIGNAL_BYTES: int = 64 * 2**10
"""A signal holding at most this many bytes of snapshots to reduce is written on the thread
that ended it when the worker is idle: what is left is mostly Python (record batches, a few
small numpy calls), which holds the GIL on either thread, so handing it over only adds a second
thread contending for the GIL (1,000 ``nn.Identity``, every forward with the directory sink:
about 6.8 -> 5.2 ms per step; benchmarks/README.md). Tests of the worker's queue set it to -1."""


class SignalThread(enum.Enum):
    """Where an ended signal is reduced and written."""

    HERE = "the thread that ended it, now"
    """Small, and nothing is queued ahead of it: the order holds without waiting."""
    WORKER = "the emission worker"
    """Host tensors: numpy releases the GIL while it sorts and sums, so the work overlaps the
    next forward and backward on a machine with a spare core."""
    HERE_AFTER_QUEUE = "the thread that ended it, once the queued signals are written"
    """Accelerator tensors (reduced on their device, by the thread that owns the stream), or
    the worker refused it (closed): earlier signals first, so sinks see the order they ended."""


def worker_allowed(
    *, default_only: bool, raises: bool, capabilities: Sequence[SinkCapabilities]
) -> bool:
    """Whether this run's reductions and writes may go to an emission worker at all (decided
    once, at attach): default metrics only, ``error_policy`` not ``raise``, and every sink
    declaring ``background_writes``."""
    return default_only and not raises and all(c.background_writes for c in capabilities)


def reduce_at_once(pending_bytes: int, nbytes: int) -> bool:
    """Whether a tensor of ``nbytes`` joining ``pending_bytes`` of snapshots overflows the
    budget: then it is not copied, and everything pending is reduced now, on the capturing
    thread."""
    return pending_bytes + nbytes > SNAPSHOT_BUDGET_BYTES


def share_at_once() -> bool:
    """Whether a reduction done at once on the capturing thread may share its work with one
    helper thread: only where the user let torch use more than one intra-op thread."""
    return torch.get_num_threads() > 1


def signal_thread(pending_bytes: int, host_only: bool, *, worker_idle: bool) -> SignalThread:
    """Where an ended signal holding ``pending_bytes`` of snapshots (all in host memory when
    ``host_only``) is reduced, on an observer that has an emission worker."""
    if pending_bytes <= INLINE_SIGNAL_BYTES and worker_idle:
        return SignalThread.HERE
    if host_only:
        return SignalThread.WORKER
    return SignalThread.HERE_AFTER_QUEUE


__all__ = [
    "INLINE_SIGNAL_BYTES",
    "SNAPSHOT_BUDGET_BYTES",
    "SignalThread",
    "reduce_at_once",
    "share_at_once",
    "signal_thread",
    "worker_allowed",
]
