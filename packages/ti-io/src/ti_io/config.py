"""Settings of the directory sink's history: part sizes, the publication delay, the window."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

OBJECT_STORE_FLUSH_SECONDS: Final[float] = 30.0
"""``flush_seconds`` of a run on an object store when no ``HistoryConfig`` is given: every
publication there is a request (one PUT per part and per TensorBoard event file), so a run
makes at most about three writes per 30 s by the clock, about 360 an hour, plus one per
``buffer_rows`` rows (docs/artifacts.md, "Runs on object storage")."""
OBJECT_STORE_BUFFER_ROWS: Final[int] = 262_144
"""``buffer_rows`` of a run on an object store when no ``HistoryConfig`` is given: four times
the local default, so a densely sampled run makes a quarter of the parts (10,000 sampled
forwards of 100 layers, 18 million history rows: about 70 history parts instead of 275), for
at most about twice as many rows buffered in memory (docs/artifacts.md)."""


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"HistoryConfig({name}=...) must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"HistoryConfig({name}=...) must be a positive int, got {value}")


@dataclass(frozen=True)
class HistoryConfig:
    """How history is buffered, published while the run is live, and summarized.

    ``flush_seconds``: every buffered row is published (as a part of
    ``history.parts/part-NNNNNN.parquet``, its histograms in ``histograms.parts/`` and
    TensorBoard) at most this long after it arrived, by the writer's own clock: a sample is
    readable about a second after its signal ended, and dense sampling makes at most one part
    per stream per ``flush_seconds`` (None: publish only by row count, at ``flush`` and at
    removal). ``buffer_rows``: a part is published sooner once this many history rows are
    buffered (a 1,000-layer model sampled every step makes about 18,000 rows per step): the
    bound on memory. ``histogram_buffer_rows``: the same for histogram rows, which hold their
    bucket lists (about 700 bytes each), so their default is smaller. Together they bound what
    a hard kill can lose: the rows of the last ``flush_seconds`` and fewer than twice
    ``buffer_rows`` history and ``histogram_buffer_rows`` histogram rows. ``window``:
    observations per window for ``recent_window_mean`` (the last ``window``, or all when
    fewer) and ``previous_window_mean`` (the up to ``window`` before those) in result.json;
    recorded in the ``ti`` footer of ``history.parquet``.
    """

    buffer_rows: int = 65_536
    window: int = 20
    histogram_buffer_rows: int = 8_192
    flush_seconds: float | None = 1.0

    def __post_init__(self) -> None:
        _positive_int("buffer_rows", self.buffer_rows)
        _positive_int("window", self.window)
        _positive_int("histogram_buffer_rows", self.histogram_buffer_rows)
        seconds = self.flush_seconds
        if seconds is None:
            return
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise TypeError(
                "HistoryConfig(flush_seconds=...) must be a number of seconds or None, "
                f"got {type(seconds).__name__}"
            )
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(
                "HistoryConfig(flush_seconds=...) must be a positive, finite number of "
                f"seconds (or None to publish by row count only), got {seconds}"
            )
