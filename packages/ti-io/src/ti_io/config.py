"""Settings of the directory sink's history: chunk size of the live parts and window length."""

from __future__ import annotations

from dataclasses import dataclass


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"HistoryConfig({name}=...) must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"HistoryConfig({name}=...) must be a positive int, got {value}")


@dataclass(frozen=True)
class HistoryConfig:
    """How history is buffered and summarized.

    ``buffer_rows``: rows held in memory before they are handed to the background writer and
    published as one ``history.parts/part-NNNNNN.parquet``; also bounds the rows a hard kill
    can lose. ``window``: observations per window for ``recent_window_mean`` (the last
    ``window``, or all when fewer) and ``previous_window_mean`` (the up to ``window`` before
    those) in result.json; recorded in the ``ti`` footer of ``history.parquet``.
    """

    buffer_rows: int = 8192
    window: int = 20

    def __post_init__(self) -> None:
        _positive_int("buffer_rows", self.buffer_rows)
        _positive_int("window", self.window)
