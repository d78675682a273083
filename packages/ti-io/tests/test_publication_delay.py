"""``HistoryConfig(flush_seconds=...)``: buffered rows are published once the oldest has waited
that long, so what a hard kill can lose is bounded in time as well as in rows
(docs/artifacts.md, "What a kill -9 loses")."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _fidelity import HISTOGRAM_KEY, assert_rows_equal
from _io_helpers import Synth

from ti_io import DirectorySink, HistoryConfig

DELAY = 1.0
"""Long enough that two writes in a row never take it on a loaded machine; short enough for a
unit test."""


def _parts(directory: Path, name: str) -> pa.Table | None:
    files = sorted((directory / name).glob("part-*.parquet"))
    return pa.concat_tables(pq.read_table(f) for f in files) if files else None


def _open(tmp_path: Path, s: Synth, flush_seconds: float | None) -> DirectorySink:
    # Row thresholds far above what the test writes: only the delay can publish.
    config = HistoryConfig(
        buffer_rows=10**6, histogram_buffer_rows=10**6, flush_seconds=flush_seconds
    )
    sink = DirectorySink(tmp_path, history_config=config)
    sink.open(s.run)
    return sink


def _settle(sink: DirectorySink) -> None:
    assert sink._writer is not None
    sink._writer.wait_idle()


def test_rows_waiting_flush_seconds_are_published_with_the_next_batch(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    s = synth()
    sink = _open(tmp_path, s, DELAY)
    history = [s.history(0), s.history(1)]
    histograms = [s.histograms(0)]
    sink.write_history(history[0])
    sink.write_histograms(histograms[0])
    sink.write_history(history[1])
    _settle(sink)
    assert _parts(tmp_path, "history.parts") is None  # younger than flush_seconds
    assert _parts(tmp_path, "histograms.parts") is None
    time.sleep(DELAY * 1.05)
    history.append(s.history(2))
    sink.write_history(history[-1])  # the oldest row has waited: everything is handed over
    _settle(sink)
    published = _parts(tmp_path, "history.parts")
    assert published is not None
    assert_rows_equal(published, history)
    hist_published = _parts(tmp_path, "histograms.parts")
    assert hist_published is not None
    assert_rows_equal(hist_published, histograms, key=HISTOGRAM_KEY)
    # The clock restarts with the next buffered row: the next batch alone is not due.
    history.append(s.history(3))
    sink.write_history(history[-1])
    _settle(sink)
    assert len(list((tmp_path / "history.parts").glob("part-*.parquet"))) == 1
    sink.close()
    assert_rows_equal(pq.read_table(tmp_path / "history.parquet"), history)


def test_histograms_alone_are_published_after_flush_seconds(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    s = synth()
    sink = _open(tmp_path, s, DELAY)
    sent = [s.histograms(0)]
    sink.write_histograms(sent[0])
    time.sleep(DELAY * 1.05)
    sent.append(s.histograms(1))
    sink.write_histograms(sent[1])  # no history row anywhere: a histogram part of its own
    _settle(sink)
    assert _parts(tmp_path, "history.parts") is None
    published = _parts(tmp_path, "histograms.parts")
    assert published is not None
    assert_rows_equal(published, sent, key=HISTOGRAM_KEY)
    sink.close()


def test_without_flush_seconds_only_counts_publish(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    s = synth()
    sink = _open(tmp_path, s, None)
    sink.write_history(s.history(0))
    sink.write_histograms(s.histograms(0))
    time.sleep(DELAY * 1.05)
    sink.write_history(s.history(1))
    sink.write_histograms(s.histograms(1))
    _settle(sink)
    assert _parts(tmp_path, "history.parts") is None
    assert _parts(tmp_path, "histograms.parts") is None
    sink.close()
    assert pq.read_metadata(tmp_path / "history.parquet").num_rows == 2 * s.history(0).num_rows


def test_defaults_bound_a_kill_in_rows_and_in_time() -> None:
    config = HistoryConfig()
    assert (config.buffer_rows, config.histogram_buffer_rows) == (65_536, 8_192)
    assert config.flush_seconds == 120.0
    assert HistoryConfig(100, 5).buffer_rows == 100  # positional order kept from 0.8.0


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (0, ValueError),
        (-1.0, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        ("60", TypeError),
        (True, TypeError),
    ],
)
def test_flush_seconds_is_checked(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"HistoryConfig\(flush_seconds=\.\.\.\)"):
        HistoryConfig(flush_seconds=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, -5])
def test_histogram_buffer_rows_is_checked(value: int) -> None:
    with pytest.raises(ValueError, match=r"HistoryConfig\(histogram_buffer_rows=\.\.\.\)"):
        HistoryConfig(histogram_buffer_rows=value)
