"""What the flight recorder is asked to do: :class:`Sentinel`, the value of ``sentinel=``."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Final

SENTINEL_SIGNALS: Final[tuple[str, ...]] = ("output", "output_gradient")
"""The signals the sentinel can check: module outputs and the gradients flowing into them."""

DEFAULT_DENSE_FORWARDS: Final[int] = 4


def check_forwards(value: object, argument: str) -> int:
    """``value`` when it is an int >= 1; else an error naming ``argument``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{argument} must be an int >= 1 (root forwards), got {value!r}")
    if value < 1:
        raise ValueError(f"{argument}={value} must be >= 1 (root forwards sampled in full)")
    return value


@dataclass(frozen=True)
class Sentinel:
    """The flight recorder's options (``inject_observer(sentinel=Sentinel(...))``;
    ``sentinel=True`` is ``Sentinel()``).

    On every root forward, sampled or not, each selected module's output tensors (and, with
    ``"output_gradient"`` in ``signals``, the gradients flowing back into them) are checked
    for NaN and infinite entries, on their own device, with one flag read per root forward.
    The first root forward in which a check fires records one ``nonfinite`` event naming the
    first module in execution order; the next ``dense_forwards`` root forwards are then
    sampled in full whatever the sampler says. Another event fires only after a root forward
    whose checks were all clean (docs/capture.md, "Flight recorder").
    """

    dense_forwards: int = DEFAULT_DENSE_FORWARDS
    """Root forwards sampled in full after an event (default 4)."""
    signals: tuple[str, ...] = SENTINEL_SIGNALS
    """What is checked: ``"output"`` and/or ``"output_gradient"`` (default both)."""

    def __post_init__(self) -> None:
        check_forwards(self.dense_forwards, "Sentinel(dense_forwards=...)")
        signals: object = self.signals
        if isinstance(signals, str | bytes) or not isinstance(signals, Collection):
            raise TypeError(
                f"Sentinel(signals=...) must be a collection of {list(SENTINEL_SIGNALS)}, "
                f"got {signals!r}"
            )
        names = list(signals)
        unknown = [s for s in names if s not in SENTINEL_SIGNALS]
        if unknown or not names:
            raise ValueError(
                f"Sentinel(signals=...) got {names!r}; choose one or both of "
                f"{list(SENTINEL_SIGNALS)}"
            )
        object.__setattr__(self, "signals", tuple(s for s in SENTINEL_SIGNALS if s in names))

    @property
    def gradients(self) -> bool:
        """Whether gradients are checked."""
        return "output_gradient" in self.signals

    @property
    def outputs(self) -> bool:
        """Whether outputs are checked."""
        return "output" in self.signals


def resolve_sentinel(value: object) -> Sentinel | None:
    """``inject_observer(sentinel=)``: False/None -> None, True -> ``Sentinel()``, a
    :class:`Sentinel` as given; anything else a TypeError naming the argument."""
    if value is None or value is False:
        return None
    if value is True:
        return Sentinel()
    if isinstance(value, Sentinel):
        return value
    raise TypeError(
        "sentinel= must be True, False or a ti_core.Sentinel(...) (e.g. "
        f"Sentinel(dense_forwards=8)), got {value!r}"
    )


__all__ = [
    "DEFAULT_DENSE_FORWARDS",
    "SENTINEL_SIGNALS",
    "Sentinel",
    "check_forwards",
    "resolve_sentinel",
]
