"""What the flight recorder is asked to do: :class:`Sentinel`, the value of ``sentinel=``."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Final, Literal, get_args

SentinelMode = Literal["replay", "dense"]
SENTINEL_MODES: Final[tuple[SentinelMode, ...]] = get_args(SentinelMode)
"""``replay`` (the default): check the root's output and the parameters' gradients, replay the
step on an event; ``dense``: check every selected module on every root forward."""

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
    """The flight recorder's options (``inject_observer(sentinel=Sentinel(...))``; the default
    ``sentinel=True`` is ``Sentinel()``).

    ``mode="replay"`` (the default): every root forward's output tensors are checked for NaN
    and infinite entries, and at the end of each backward the gradients of the selected
    modules' parameters (and of the root's inputs that require grad), on their own device,
    with one flag read per check. When one fires, the step is re-run with a check on every
    selected module, to name the first module and to tell real numerics (``reproduced``) from
    a transient fault of the device (``not_reproduced``), a value that came from another rank
    (``from_another_rank``) or a step that cannot be re-run (``not_replayable``).

    ``mode="dense"``: each selected module's output tensors (and, with ``"output_gradient"``
    in ``signals``, the gradients flowing back into them) are checked on every root forward;
    the event names the first flagged module in execution order, with no replay.

    Either way, the first root forward in which a check fires records one ``nonfinite`` event,
    the next ``dense_forwards`` root forwards are sampled in full whatever the sampler says,
    and another event fires only after a root forward whose checks were all clean
    (docs/capture.md, "Flight recorder").
    """

    dense_forwards: int = DEFAULT_DENSE_FORWARDS
    """Root forwards sampled in full after an event (default 4)."""
    signals: tuple[str, ...] = SENTINEL_SIGNALS
    """What is checked: ``"output"`` and/or ``"output_gradient"`` (default both). In replay
    mode ``"output"`` is the root's output and ``"output_gradient"`` the parameters'
    gradients."""
    mode: SentinelMode = "replay"
    """``"replay"`` (default) or ``"dense"``: see above."""

    def __post_init__(self) -> None:
        check_forwards(self.dense_forwards, "Sentinel(dense_forwards=...)")
        if self.mode not in SENTINEL_MODES:
            raise ValueError(
                f"Sentinel(mode=...) got {self.mode!r}; choose 'replay' (check at the root, "
                "replay the step on an event) or 'dense' (check every selected module on every "
                "forward)"
            )
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
    def replays(self) -> bool:
        """Whether this is replay mode."""
        return self.mode == "replay"

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
    "SENTINEL_MODES",
    "SENTINEL_SIGNALS",
    "Sentinel",
    "SentinelMode",
    "check_forwards",
    "resolve_sentinel",
]
