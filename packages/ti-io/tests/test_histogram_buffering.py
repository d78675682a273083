"""Histograms are buffered with the history rows and published with them (by the clock, with
each history part, every ``histogram_buffer_rows`` histogram rows, and at flush/close); none is
lost or duplicated."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _io_helpers import Synth

import ti_io.write.parts
from ti_io import DirectorySink, HistoryConfig
from ti_schema import validate_histograms


def _part_rows(directory: Path) -> int:
    parts = sorted((directory / "histograms.parts").glob("*.parquet"))
    return sum(pq.read_metadata(p).num_rows for p in parts)


def test_histograms_reach_the_writer_only_in_chunks(
    tmp_path: Path, synth: Callable[..., Synth], monkeypatch: pytest.MonkeyPatch
) -> None:
    s = synth()
    published: list[int] = []
    original = ti_io.write.parts.PartWriter._publish

    def counting(
        self: ti_io.write.parts.PartWriter,
        history: list[pa.RecordBatch],
        histograms: list[pa.RecordBatch],
    ) -> None:
        published.append(len(histograms))
        original(self, history, histograms)

    monkeypatch.setattr(ti_io.write.parts.PartWriter, "_publish", counting)
    # Large buffers and no clock: no part is due during the 12 samples.
    config = HistoryConfig(buffer_rows=10_000, window=3, flush_seconds=None)
    sink = DirectorySink(tmp_path, history_config=config)
    sink.open(s.run)
    per_sample = s.histograms(0).num_rows
    for sample in range(12):
        sink.write_history(s.history(sample))
        sink.write_histograms(s.histograms(sample))
    assert published == []  # buffered: the writer was not woken per batch
    assert _part_rows(tmp_path) == 0
    sink.flush()  # publishes everything buffered, in one publication
    assert published == [12]
    assert _part_rows(tmp_path) == 12 * per_sample
    sink.write_histograms(s.histograms(12))
    sink.close()
    final = pq.read_table(tmp_path / "histograms.parquet")
    validate_histograms(final)
    assert final.num_rows == 13 * per_sample
    assert sorted(set(final.column("sample_id").to_pylist())) == list(range(13))


def test_histograms_follow_each_history_part(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    s = synth()
    per_sample = s.histograms(0).num_rows
    rows_per_sample = s.history(0).num_rows
    sink = DirectorySink(
        tmp_path, history_config=HistoryConfig(buffer_rows=rows_per_sample * 4, window=3)
    )
    sink.open(s.run)
    for sample in range(4):  # the 4th history batch makes a part due
        sink.write_histograms(s.histograms(sample))
        sink.write_history(s.history(sample))
    assert sink._writer is not None
    sink._writer.wait_idle()
    assert len(list((tmp_path / "history.parts").glob("*.parquet"))) == 1
    assert _part_rows(tmp_path) == 4 * per_sample  # published with the history part
    sink.close()
    assert pq.read_metadata(tmp_path / "histograms.parquet").num_rows == 4 * per_sample


def test_a_full_histogram_chunk_is_published_at_once(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    """``histogram_buffer_rows`` histogram rows, with no history part due, become a histogram
    part as soon as the writer has them (at exactly the threshold), not at the next history
    part."""
    s = synth()
    per_sample = s.histograms(0).num_rows
    sink = DirectorySink(
        tmp_path, history_config=HistoryConfig(histogram_buffer_rows=2 * per_sample, window=3)
    )
    sink.open(s.run)
    sink.write_histograms(s.histograms(0))
    sink.write_histograms(s.histograms(1))  # exactly buffer_rows: handed over
    assert sink._writer is not None
    sink._writer.wait_idle()
    parts = sorted((tmp_path / "histograms.parts").glob("*.parquet"))
    assert [pq.read_metadata(p).num_rows for p in parts] == [2 * per_sample]
    assert not list((tmp_path / "history.parts").glob("*.parquet"))
    sink.write_histograms(s.histograms(2))
    sink.write_histograms(s.histograms(3))
    sink._writer.wait_idle()
    parts = sorted((tmp_path / "histograms.parts").glob("*.parquet"))
    assert [p.name for p in parts] == ["part-000000.parquet", "part-000001.parquet"]
    assert [pq.read_metadata(p).num_rows for p in parts] == [2 * per_sample] * 2
    sink.write_histograms(s.histograms(4))
    sink.close()
    final = pq.read_table(tmp_path / "histograms.parquet")
    assert sorted(set(final.column("sample_id").to_pylist())) == [0, 1, 2, 3, 4]
    assert final.num_rows == 5 * per_sample
