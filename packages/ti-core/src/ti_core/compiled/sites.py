"""The tensor paths of each traced output, numbered at trace time: an operator schema has no
list-of-strings type, so ``record_call`` carries the number (:mod:`~ti_core.compiled.operators`).
"""

from __future__ import annotations

import threading


class Sites:
    """The tensor paths of each traced output, numbered at trace time (shared by threads)."""

    def __init__(self) -> None:
        self._numbers: dict[tuple[str, ...], int] = {}
        self._paths: list[tuple[str, ...]] = []
        self._lock = threading.Lock()

    def intern(self, paths: tuple[str, ...]) -> int:
        """The number of ``paths`` (stable: the same paths always get the same number)."""
        with self._lock:
            number = self._numbers.get(paths)
            if number is None:
                number = self._numbers[paths] = len(self._paths)
                self._paths.append(paths)
            return number

    def paths(self, number: int) -> tuple[str, ...]:
        return self._paths[number]


__all__ = ["Sites"]
