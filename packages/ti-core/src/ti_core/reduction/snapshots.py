"""Recycled host buffers for the snapshots that sampled tensors are copied into.

A snapshot (docs/capture.md, "What is captured per call") lives from the module boundary until
its signal is reduced, often on the emission worker. Giving each one fresh memory costs more
than the copy: the allocator hands freed megabyte-sized blocks back to the system, so every new
snapshot page-faults again. The pool keeps the buffers of reduced snapshots for the next sample
of the same shape.

Ownership: one pool per observer, filled by the thread that reduced a batch, drained by the
thread that captures; bounded by ``max_bytes``; dropped with the observer.
"""

from __future__ import annotations

import threading
from typing import Final

import torch

POOL_BYTES: Final[int] = 16 * 2**20
"""Bytes of idle buffers kept at most (per observer)."""


class SnapshotPool:
    """Idle snapshot buffers by (shape, dtype); plain contiguous CPU tensors only."""

    def __init__(self, max_bytes: int = POOL_BYTES) -> None:
        self._max_bytes = max_bytes
        self._free: dict[tuple[torch.Size, torch.dtype], list[torch.Tensor]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def poolable(t: torch.Tensor) -> bool:
        """Whether a plain copy of ``t`` into a fresh contiguous buffer is an exact snapshot."""
        return (
            type(t) is torch.Tensor
            and t.device.type == "cpu"
            and t.layout == torch.strided
            and t.is_contiguous()
            and not t.is_conj()
            and not t.is_neg()
            and not t.is_quantized
        )

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of the poolable tensor ``t`` in a recycled (or new) buffer."""
        key = (t.shape, t.dtype)
        buf = None
        with self._lock:
            idle = self._free.get(key)
            if idle:
                buf = idle.pop()
                self._bytes -= buf.numel() * buf.element_size()
        if buf is None:
            buf = torch.empty(t.shape, dtype=t.dtype)
        buf.copy_(t)
        return buf

    def recycle(self, buffers: list[torch.Tensor]) -> None:
        """Keep ``buffers`` (copies from :meth:`copy` nobody reads any more) for reuse."""
        with self._lock:
            for buf in buffers:
                nbytes = buf.numel() * buf.element_size()
                if self._bytes + nbytes > self._max_bytes:
                    continue
                self._free.setdefault((buf.shape, buf.dtype), []).append(buf)
                self._bytes += nbytes


__all__ = ["POOL_BYTES", "SnapshotPool"]
