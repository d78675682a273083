"""The one error every validator raises, listing every problem it found."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal, get_args

MismatchKind = Literal[
    "missing_column",
    "extra_column",
    "duplicate_column",
    "type",
    "nullability",
    "missing_metadata",
    "foreign_metadata",
    "unsupported_version",
    "data",
    "json",
]
"""The kind of one problem (:attr:`Mismatch.kind`)."""

MISMATCH_KINDS: Final[tuple[MismatchKind, ...]] = get_args(MismatchKind)
"""Every value :attr:`Mismatch.kind` takes, so callers can branch on the kind of problem."""


@dataclass(frozen=True)
class Mismatch:
    """One problem: its kind (one of :data:`MISMATCH_KINDS`), where it is, and what to do."""

    kind: MismatchKind
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message


class SchemaMismatchError(ValueError):
    """Data does not conform to the ti contract; ``mismatches`` lists every problem found."""

    def __init__(self, subject: str, mismatches: Iterable[Mismatch]) -> None:
        self.subject = subject
        self.mismatches: tuple[Mismatch, ...] = tuple(mismatches)
        count = len(self.mismatches)
        lines = "\n".join(f"  - {m}" for m in self.mismatches)
        noun = "problem" if count == 1 else "problems"
        super().__init__(f"{subject} does not conform ({count} {noun}):\n{lines}")

    @property
    def kinds(self) -> frozenset[MismatchKind]:
        """The distinct kinds of problem found."""
        return frozenset(m.kind for m in self.mismatches)
