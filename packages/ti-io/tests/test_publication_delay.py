"""``HistoryConfig(flush_seconds=...)``: the writer publishes buffered rows on its own clock,
at most that long after the oldest arrived, with no next batch needed; rows that arrive within
one delay share a part (docs/artifacts.md, "Lifecycle")."""

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
"""Long enough that a few writes in a row never take it on a loaded machine; short enough for a
unit test."""
PATIENCE = 30.0
"""How long a test waits for a publication before it fails (a deadlock guard, not a timing)."""


def _parts(directory: Path, name: str) -> pa.Table | None:
    files = sorted((directory / name).glob("part-*.parquet"))
    return pa.concat_tables(pq.read_table(f) for f in files) if files else None


def _count(directory: Path, name: str) -> int:
    return len(list((directory / name).glob("part-*.parquet")))


def _open(tmp_path: Path, s: Synth, flush_seconds: float | None) -> DirectorySink:
    # Row thresholds far above what the test writes: only the clock can publish.
    config = HistoryConfig(
        buffer_rows=10**6, histogram_buffer_rows=10**6, flush_seconds=flush_seconds
    )
    sink = DirectorySink(tmp_path, history_config=config)
    sink.open(s.run)
    return sink


def _wait_for(directory: Path, name: str, parts: int) -> float:
    """Seconds until ``directory/name`` holds ``parts`` parts (fails after PATIENCE)."""
    start = time.monotonic()
    while _count(directory, name) < parts:
        assert time.monotonic() - start < PATIENCE, f"no part in {name} after {PATIENCE} s"
        time.sleep(0.02)
    return time.monotonic() - start


def test_rows_are_published_by_the_clock_without_a_next_batch(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    s = synth()
    sink = _open(tmp_path, s, DELAY)
    history = [s.history(0), s.history(1)]
    histograms = [s.histograms(0)]
    written = time.monotonic()
    sink.write_history(history[0])
    sink.write_histograms(histograms[0])
    sink.write_history(history[1])
    assert sink._writer is not None
    sink._writer.wait_idle()  # nothing is due yet: the rows are younger than the delay
    assert _parts(tmp_path, "history.parts") is None
    _wait_for(tmp_path, "history.parts", 1)  # no further write: the writer's clock publishes
    assert time.monotonic() - written >= DELAY
    published = _parts(tmp_path, "history.parts")
    assert published is not None
    assert_rows_equal(published, history)  # the three batches of one delay: one part
    _wait_for(tmp_path, "histograms.parts", 1)
    hist_published = _parts(tmp_path, "histograms.parts")
    assert hist_published is not None
    assert_rows_equal(hist_published, histograms, key=HISTOGRAM_KEY)
    # The clock restarts with the next buffered row.
    history.append(s.history(2))
    sink.write_history(history[-1])
    _wait_for(tmp_path, "history.parts", 2)
    assert _count(tmp_path, "history.parts") == 2
    sink.close()
    assert_rows_equal(pq.read_table(tmp_path / "history.parquet"), history)


def test_dense_writes_are_coalesced_into_one_part_per_delay(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    s = synth()
    sink = _open(tmp_path, s, DELAY)
    sent = []
    start = time.monotonic()
    sample = 0
    while time.monotonic() - start < 3 * DELAY:  # a batch every 10 ms for three delays
        sent.append(s.history(sample))
        sink.write_history(sent[-1])
        sample += 1
        time.sleep(0.01)
    elapsed = time.monotonic() - start
    parts = _count(tmp_path, "history.parts")
    # At most one part per delay (plus the one whose clock started last), never one per batch.
    assert 1 <= parts <= math.ceil(elapsed / DELAY) + 1, (parts, elapsed, len(sent))
    assert len(sent) > 10 * parts
    sink.close()
    assert_rows_equal(pq.read_table(tmp_path / "history.parquet"), sent)


def test_histograms_alone_are_published_by_the_clock(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    s = synth()
    sink = _open(tmp_path, s, DELAY)
    sent = [s.histograms(0), s.histograms(1)]
    for batch in sent:
        sink.write_histograms(batch)
    _wait_for(tmp_path, "histograms.parts", 1)  # no history row anywhere: a part of its own
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
    time.sleep(DELAY * 1.5)
    sink.write_history(s.history(1))
    sink.write_histograms(s.histograms(1))
    assert sink._writer is not None
    sink._writer.wait_idle()
    assert _parts(tmp_path, "history.parts") is None
    assert _parts(tmp_path, "histograms.parts") is None
    sink.close()
    assert pq.read_metadata(tmp_path / "history.parquet").num_rows == 2 * s.history(0).num_rows


def test_defaults_bound_a_kill_in_rows_and_in_time() -> None:
    config = HistoryConfig()
    assert (config.buffer_rows, config.histogram_buffer_rows) == (65_536, 8_192)
    assert config.flush_seconds == 1.0
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
