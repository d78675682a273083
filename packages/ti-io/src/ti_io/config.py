"""Settings of the directory sink's history: part sizes, the publication delay, the window."""

from __future__ import annotations

import math
from dataclasses import dataclass


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
