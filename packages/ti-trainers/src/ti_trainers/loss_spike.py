"""``LossSpike``: the test a callback's ``loss_trigger=`` runs on every loss the trainer logs.

Pure and standalone (no torch, no trainer): :meth:`LossSpike.check` takes one logged loss and
says why it is alarming, or None. The callbacks call it at the trainer's logging cadence and
turn a reason into ``ti_core.trigger_capture(model, kind="loss", value=loss, reason=...)``.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Final

DEFAULT_Z: Final[float] = 4.0
DEFAULT_WINDOW: Final[int] = 50
DEFAULT_MIN_HISTORY: Final[int] = 10
_TESTS: Final = ("nonfinite", "spike")


class LossSpike:
    """Fires on a non-finite loss, or on a loss more than ``z`` standard deviations above the
    mean of the previous ``window`` finite losses.

    - **Non-finite** (NaN, ±inf): fires at once, whatever the history; never added to it.
    - **Spike**: ``loss > mean + z * sd`` of the window *before* this loss (population
      standard deviation, ddof=0), tested once the window holds ``min_history`` losses. A
      window of equal losses has ``sd == 0``: any loss above them fires.
    - Every finite loss joins the window after its test (a spike too, so the mean and the
      deviation follow a loss that settles at a new level).
    - **One firing per excursion**, per test: after a non-finite loss, the next non-finite
      one fires only after a finite loss; after a spike, the next spike fires only after a
      loss below the threshold. A loss that stays NaN or high asks for one capture, not one per
      logged step (as the non-finite sentinel does); a NaN right after a spike still fires.

    ``LossSpike(z=4.0, window=50, min_history=10)`` is the default of ``loss_trigger=True``.
    """

    def __init__(
        self,
        z: float = DEFAULT_Z,
        window: int = DEFAULT_WINDOW,
        min_history: int = DEFAULT_MIN_HISTORY,
    ) -> None:
        if isinstance(z, bool) or not isinstance(z, int | float):
            raise TypeError(f"LossSpike(z=...) must be a number of standard deviations, got {z!r}")
        if not math.isfinite(z) or z <= 0:
            raise ValueError(f"LossSpike(z={z!r}) must be a finite number > 0, e.g. 4.0")
        for name, value, low in (("window", window, 2), ("min_history", min_history, 2)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"LossSpike({name}=...) must be an int (losses), got {value!r}")
            if value < low:
                raise ValueError(
                    f"LossSpike({name}={value}) must be >= {low}: a standard deviation needs "
                    "two losses"
                )
        if min_history > window:
            raise ValueError(
                f"LossSpike(min_history={min_history}) is more than window={window}: the window "
                "never holds that many losses; lower min_history or widen the window"
            )
        self.z = float(z)
        self.window = window
        self.min_history = min_history
        self._losses: deque[float] = deque(maxlen=window)
        self._armed = dict.fromkeys(_TESTS, True)

    @property
    def history(self) -> tuple[float, ...]:
        """The finite losses the next spike test compares against, oldest first."""
        return tuple(self._losses)

    def check(self, loss: float) -> str | None:
        """Test one logged loss (then remember it when finite): the reason it fires, e.g.
        ``"loss 9.5 > mean 1.2 + 4 sd (0.3) of the last 50"`` or ``"loss nan is not finite"``,
        or None."""
        if isinstance(loss, bool) or not isinstance(loss, int | float):
            raise TypeError(f"LossSpike.check(loss=...) must be a float, got {loss!r}")
        loss = float(loss)
        if not math.isfinite(loss):
            return self._fire("nonfinite", f"loss {loss} is not finite")
        self._armed["nonfinite"] = True
        reason = None
        count = len(self._losses)
        if count >= self.min_history:
            mean = math.fsum(self._losses) / count
            sd = math.sqrt(math.fsum((x - mean) ** 2 for x in self._losses) / count)
            if loss > mean + self.z * sd:
                reason = (
                    f"loss {loss:.6g} > mean {mean:.6g} + {self.z:g} sd ({sd:.6g}) of the last "
                    f"{count}"
                )
        self._losses.append(loss)
        if reason is None:
            self._armed["spike"] = True
            return None
        return self._fire("spike", reason)

    def _fire(self, test: str, reason: str) -> str | None:
        if not self._armed[test]:
            return None
        self._armed[test] = False
        return reason

    def reset(self) -> None:
        """Forget the history and re-arm (a callback does it when a new run starts)."""
        self._losses.clear()
        self._armed = dict.fromkeys(_TESTS, True)

    def __repr__(self) -> str:
        return f"LossSpike(z={self.z:g}, window={self.window}, min_history={self.min_history})"


def resolve_loss_trigger(value: object, owner: str) -> LossSpike | None:
    """A callback's ``loss_trigger=``: None/False -> off, True -> ``LossSpike()``, a
    :class:`LossSpike` as given; anything else a TypeError naming the argument."""
    if value is None or value is False:
        return None
    if value is True:
        return LossSpike()
    if isinstance(value, LossSpike):
        return value
    raise TypeError(
        f"{owner}(loss_trigger=...) must be True (LossSpike()), a ti_trainers.LossSpike, or "
        f"None/False (off); got {value!r}"
    )


__all__ = ["LossSpike", "resolve_loss_trigger"]
