"""How a failure is named to the error policy: the stage it happened in, derived from the signal.

The name is part of every warning (``ti-core: parameter gradient capture failed ...``) and keys
the policy's one-warning-per-kind rule. A signal's stages are its name in words, then ``capture``
or ``emission``; the two output signals keep the words of their first release.
"""

from __future__ import annotations

from typing import Final, Literal

Step = Literal["capture", "emission"]
"""Capturing a signal's tensors (on the training thread, in a hook), or emitting it once it
ended (reduction, record batches, the sinks)."""

_WORDS: Final[dict[tuple[str, Step], str]] = {
    ("output", "emission"): "forward",
    ("output_gradient", "capture"): "gradient",
    ("output_gradient", "emission"): "gradient",
}
"""Where a stage's words are not the signal's name with spaces."""

SAMPLING: Final = "sampling"
"""Deciding whether a root forward is sampled, and starting its sample."""
REDUCTION: Final = "reduction"
"""Reducing one tensor of an ended signal (its other tensors are kept)."""


def stage_of(signal: str, step: Step) -> str:
    """The stage of ``step`` for ``signal``: ``parameter_update`` -> ``parameter update
    capture`` / ``parameter update emission``; ``output`` -> ``output capture`` / ``forward
    emission``."""
    return f"{_WORDS.get((signal, step), signal.replace('_', ' '))} {step}"


__all__ = ["REDUCTION", "SAMPLING", "Step", "stage_of"]
