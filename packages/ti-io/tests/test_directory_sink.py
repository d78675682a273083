"""DirectorySink driven with synthetic ti-schema batches: artifacts, parts, refusal, faults."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _fidelity import (
    HISTOGRAM_KEY,
    assert_final_files_match,
    assert_result_json_matches,
    assert_rows_equal,
)
from _io_helpers import Synth, make_run

import ti_io.write.parts
from ti_io import ArtifactWriteError, DirectorySink, HistoryConfig, scan_history
from ti_schema import (
    DEFAULT_METRICS,
    SCHEMA_VERSION,
    parse_metadata,
    validate_histograms,
    validate_history,
    validate_result_json,
)
from ti_schema.testing import load_strict_json


def run_sink(
    out: Path, synth: Synth, samples: int, *, buffer_rows: int = 100, window: int = 3
) -> tuple[DirectorySink, dict[str, list[pa.RecordBatch]]]:
    """A sink fed ``samples`` synthetic samples (odd ones dictionary-encoded), and what was sent."""
    sink = DirectorySink(out, history_config=HistoryConfig(buffer_rows=buffer_rows, window=window))
    sink.open(synth.run)
    sent: dict[str, list[pa.RecordBatch]] = {"history": [], "histograms": []}
    for sample in range(samples):
        sent["history"].append(synth.history(sample, dictionary=sample % 2 == 1))
        sent["histograms"].append(synth.histograms(sample))
        sink.write_history(sent["history"][-1])
        sink.write_histograms(sent["histograms"][-1])
    return sink, sent


def test_artifacts_have_exact_rows_and_conform(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    s = synth(empty_every=4)
    sink, sink_sent = run_sink(tmp_path / "stats", s, samples=25)
    sink.close()
    out = tmp_path / "stats"
    assert sorted(p.name for p in out.iterdir()) == [
        "events.parquet",
        "histograms.parquet",
        "history.parquet",
        "index.md",
        "result.json",
        "tensorboard",
    ]
    history = pq.read_table(out / "history.parquet")
    tensors = 2 * len(s.run.layers)
    assert history.num_rows == 25 * tensors * len(DEFAULT_METRICS)
    validate_history(history)
    histograms = pq.read_table(out / "histograms.parquet")
    assert histograms.num_rows == 25 * 2 * len(s.run.focus_layers)
    validate_histograms(histograms)
    validate_result_json(load_strict_json(out / "result.json"))
    meta = json.loads(history.schema.metadata[b"ti"])
    assert meta == {
        "schema": "ti.history",
        "schema_version": SCHEMA_VERSION,
        "producer": "ti-io tests",
        "window": 3,  # the run fact of contract 1.1: result.json's window
    }
    # Every row, value included, is what was sent (dictionary-encoded input as plain strings).
    assert_rows_equal(history, sink_sent["history"])
    assert_rows_equal(histograms, sink_sent["histograms"], HISTOGRAM_KEY)
    assert_result_json_matches(load_strict_json(out / "result.json"), sink_sent["history"], 3)


def test_catalog_and_index_readable_before_close(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    layers = (("enc", "Linear"), ("never.ran", "Dropout"))
    run = make_run(layers)
    sink = DirectorySink(tmp_path)
    sink.open(run)
    records = load_strict_json(tmp_path / "result.json")
    assert records == [
        {"layer": "enc", "type": "Linear", "aliases": [], "tensors": []},
        {"layer": "never.ran", "type": "Dropout", "aliases": [], "tensors": []},
    ]
    validate_result_json(records)
    assert "Status: live" in (tmp_path / "index.md").read_text()
    sink.close()
    final = load_strict_json(tmp_path / "result.json")
    assert [r["layer"] for r in final] == ["enc", "never.ran"]
    assert final[1]["tensors"] == []  # selected, never executed: still listed


def test_parts_are_readable_while_running(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    s = synth()
    per_sample = 2 * len(s.run.layers) * len(DEFAULT_METRICS)  # 36 rows
    sink, sent = run_sink(tmp_path, s, samples=10, buffer_rows=50)
    sink.flush()
    parts = sorted((tmp_path / "history.parts").glob("*.parquet"))
    assert len(parts) >= 2
    live = scan_history(tmp_path).collect()
    assert live.height == 10 * per_sample
    assert live.get_column("sample_id").unique().sort().to_list() == list(range(10))
    for part in parts:  # each part is a complete, conforming Parquet file
        validate_history(pq.read_table(part))
        _assert_lz4_with_string_dictionaries(part)
    assert_rows_equal(pa.concat_tables(pq.read_table(p) for p in parts), sent["history"])
    assert_rows_equal(live.to_arrow(), sent["history"])
    sent["history"].append(s.history(10))
    sink.write_history(sent["history"][-1])
    sink.close()
    assert scan_history(tmp_path).select(pl.len()).collect().item() == 11 * per_sample
    assert_rows_equal(pq.read_table(tmp_path / "history.parquet"), sent["history"])
    assert not (tmp_path / "history.parts").exists()
    final = pq.ParquetFile(tmp_path / "history.parquet").metadata
    for c in range(final.num_columns):  # the final file is written for size and for queries
        column = final.row_group(0).column(c)
        assert column.compression == "ZSTD", column.path_in_schema
        assert column.is_stats_set, column.path_in_schema


def _assert_lz4_with_string_dictionaries(path: Path) -> None:
    """docs/artifacts.md: parts are LZ4-compressed, without column statistics, with dictionary
    encoding on the string columns only (the final files are zstd, with statistics)."""
    meta = pq.ParquetFile(path).metadata
    schema = pq.read_schema(path)
    assert meta.num_row_groups >= 1
    for g in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            column = meta.row_group(g).column(c)
            name = column.path_in_schema.split(".")[0]
            assert column.compression in ("LZ4", "LZ4_RAW"), (path.name, name)
            assert not column.is_stats_set, (path.name, name)
            dictionary = any("DICTIONARY" in e for e in column.encodings)
            assert dictionary == pa.types.is_string(schema.field(name).type), (path.name, name)


def test_result_json_matches_numpy_reference(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    window = 4
    s = synth(empty_every=3, seed=7)
    # Deliver samples out of order (as backwards may): aggregates must follow sample_id.
    sink = DirectorySink(tmp_path, history_config=HistoryConfig(buffer_rows=64, window=window))
    sink.open(s.run)
    batches = {i: s.history(i) for i in range(23)}
    for i in [*range(10, 23), *range(10)]:
        sink.write_history(batches[i])
    sink.close()
    sent = list(batches.values())
    assert_rows_equal(pq.read_table(tmp_path / "history.parquet"), sent)
    records = load_strict_json(tmp_path / "result.json")
    checked = assert_result_json_matches(records, sent, window)  # numpy, from the sent batches
    assert checked == 2 * len(s.run.layers) * len(DEFAULT_METRICS)
    gradient = next(t for t in records[-1]["tensors"] if t["signal"] == "output_gradient")
    stats = gradient["statistics"]["mean"]
    assert stats["unavailable"] == 8  # samples 0, 3, ..., 21 are empty tensors
    assert stats["observations"] == 15
    assert gradient["latest_shape"] == [8, 4]  # sample 22 is not empty


def test_null_aggregates_carry_reasons(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    s = synth(empty_every=1)  # the last layer's gradient is always empty
    sink, _ = run_sink(tmp_path, s, samples=5, window=3)
    sink.close()
    records = load_strict_json(tmp_path / "result.json")
    empty = next(t for t in records[-1]["tensors"] if t["signal"] == "output_gradient")
    stats = empty["statistics"]["p50"]
    assert stats["observations"] == 0
    assert stats["unavailable"] == 5
    assert stats["mean"] is None
    assert stats["unavailable_reason"] == "all 5 samples unavailable: empty tensor (numel=0)"
    partial = records[0]["tensors"][0]["statistics"]["mean"]  # 5 observations, window 3
    assert partial["recent_window_mean"] is not None
    assert partial["previous_window_mean"] is not None  # the 2 observations before the last 3
    assert partial["unavailable_reason"] is None


def test_short_histories_get_partial_window_means(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    """25 observations, window 20 (the default): the last 20 and the 5 before them; a history
    no longer than the window has a recent mean and an explained null previous mean."""
    s = synth(seed=3)
    sent: dict[int, list[pa.RecordBatch]] = {}
    for samples, out in ((25, tmp_path / "long"), (6, tmp_path / "short")):
        sink = DirectorySink(out)
        sink.open(s.run)
        sent[samples] = [s.history(sample) for sample in range(samples)]
        for batch in sent[samples]:
            sink.write_history(batch)
        sink.close()
    assert_result_json_matches(load_strict_json(tmp_path / "long" / "result.json"), sent[25], 20)
    assert_result_json_matches(load_strict_json(tmp_path / "short" / "result.json"), sent[6], 20)
    values = np.array(
        [
            row["value"]
            for batch in sent[25]
            for row in batch.to_pylist()
            if (row["layer"], row["signal"], row["metric"])
            == (s.run.layers[0].name, "output", "mean")
        ]
    )
    assert len(values) == 25
    stats = load_strict_json(tmp_path / "long" / "result.json")[0]["tensors"][0]["statistics"]
    assert stats["mean"]["recent_window_mean"] == pytest.approx(values[5:].mean(), rel=1e-12)
    assert stats["mean"]["previous_window_mean"] == pytest.approx(values[:5].mean(), rel=1e-12)
    short = load_strict_json(tmp_path / "short" / "result.json")[0]["tensors"][0]["statistics"]
    assert short["mean"]["recent_window_mean"] is not None
    assert short["mean"]["previous_window_mean"] is None
    assert short["mean"]["unavailable_reason"] == (
        "previous_window_mean has no observations: all 6 are in the recent window of 20"
    )
    footer = pq.read_metadata(tmp_path / "short" / "history.parquet").metadata
    assert parse_metadata(footer)["window"] == 20  # the run's window is in its facts


def test_nan_values_never_reach_json(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    s = synth()
    sink = DirectorySink(tmp_path)
    sink.open(s.run)
    batch = s.history(0)
    values = batch.column("value").to_numpy(zero_copy_only=False).copy()
    values[0] = np.nan  # a custom reducer may produce NaN
    sink.write_history(
        batch.set_column(batch.schema.get_field_index("value"), "value", pa.array(values))
    )
    sink.close()
    text = (tmp_path / "result.json").read_text()
    assert re.search(r"[:\[,]\s*-?(NaN|Infinity)", text) is None  # no bare tokens
    stats = load_strict_json(tmp_path / "result.json")[0]["tensors"][0]["statistics"]["mean"]
    assert stats["mean"] is None
    assert "not finite" in stats["unavailable_reason"]


def test_existing_run_is_refused_untouched(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    s = synth()
    run_sink(tmp_path, s, samples=3)[0].close()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(FileExistsError, match=r"overwrite=True") as caught:
        DirectorySink(tmp_path).open(s.run)
    assert str(tmp_path) in str(caught.value)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_overwrite_replaces_only_our_artifacts(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    s = synth()
    run_sink(tmp_path, s, samples=3)[0].close()
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "tensorboard" / "keep.txt").write_text("mine too")
    live, _ = run_sink(tmp_path / "live", s, samples=2)
    with pytest.raises(FileExistsError):
        DirectorySink(tmp_path / "live").open(s.run)  # a live run is a run too
    live.close()
    sink = DirectorySink(tmp_path, overwrite=True)
    sink.open(s.run)
    sink.write_history(s.history(0))
    sink.close()
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "tensorboard" / "keep.txt").read_text() == "mine too"
    assert pl.read_parquet(tmp_path / "history.parquet").get_column(
        "sample_id"
    ).unique().to_list() == [0]


def test_rank_subdir(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    run = make_run(rank_subdir="rank-001")
    sink = DirectorySink(tmp_path)
    sink.open(run)
    sink.write_history(Synth(run).history(0))
    sink.close()
    assert (tmp_path / "rank-001" / "history.parquet").is_file()
    with pytest.raises(FileNotFoundError, match="scan_ranks"):
        scan_history(tmp_path)
    with pytest.raises(ValueError, match="rank_subdir"):
        DirectorySink(tmp_path / "x").open(make_run(rank_subdir="../escape"))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"output_dir": 3}, TypeError, "output_dir"),
        ({"output_dir": ""}, ValueError, "output_dir"),
        ({"output_dir": "x", "history_config": {"window": 3}}, TypeError, "history_config"),
        ({"output_dir": "x", "overwrite": "yes"}, TypeError, "overwrite"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        DirectorySink(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"buffer_rows": 0}, "buffer_rows"),
        ({"window": -1}, "window"),
        ({"window": 2.5}, "window"),
        ({"buffer_rows": True}, "buffer_rows"),
    ],
)
def test_history_config_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        HistoryConfig(**kwargs)


def test_construction_does_no_io(tmp_path: Path) -> None:
    DirectorySink(tmp_path / "not" / "yet")
    assert not (tmp_path / "not").exists()


def test_wrong_batch_schema_is_refused(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    s = synth()
    sink = DirectorySink(tmp_path)
    sink.open(s.run)
    batch = s.history(0)
    with pytest.raises(ValueError, match="history_schema"):
        sink.write_history(batch.drop_columns(["dtype"]))
    with pytest.raises(ValueError, match="'value'"):
        sink.write_history(batch.set_column(15, "value", pa.array(["x"] * batch.num_rows)))
    sink.close()


def test_write_failure_is_reported_and_the_rest_survives(
    tmp_path: Path, synth: Callable[..., Synth], monkeypatch: pytest.MonkeyPatch
) -> None:
    s = synth()
    real = ti_io.write.parts.write_parquet
    attempts: list[str] = []

    def full(path: Path, table: pa.Table) -> None:
        attempts.append(path.name)
        if path.name == "part-000001.parquet":  # the second part hits a lasting full disk
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, table)

    monkeypatch.setattr(ti_io.write.parts, "write_parquet", full)
    per_sample = 2 * len(s.run.layers) * len(DEFAULT_METRICS)
    sink = DirectorySink(tmp_path, history_config=HistoryConfig(flush_seconds=None))
    sink.open(s.run)
    sink.write_history(s.history(0))
    sink.flush()  # part 0
    sink.write_history(s.history(1))
    with pytest.raises(ArtifactWriteError, match="No space left") as caught:
        sink.flush()
    assert caught.value.rows_lost == per_sample
    assert "part-000001.parquet" in str(caught.value)
    assert caught.value.paths == (str(tmp_path / "history.parts" / "part-000001.parquet"),)
    assert f"lost {per_sample} history rows" in str(caught.value)
    assert attempts.count("part-000001.parquet") == 2  # written once more before giving up
    sink.write_history(s.history(2))
    sink.close()  # finalizes what was published
    kept = pl.read_parquet(tmp_path / "history.parquet").get_column("sample_id").unique().sort()
    assert kept.to_list() == [0, 2]


def test_a_failing_tensorboard_event_file_is_reported_and_costs_no_rows(
    tmp_path: Path, synth: Callable[..., Synth], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event file failing (EIO) is reported once, naming the file and the histograms it
    lost; history and histogram parts, and the finalized files, keep every row."""
    s = synth()

    def broken(self: object, batch: pa.RecordBatch) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ti_io.write.parts.EventFileHistograms, "write", broken)
    sink, sent = run_sink(tmp_path, s, samples=3, buffer_rows=10_000)
    with pytest.raises(ArtifactWriteError, match="Input/output error") as caught:
        sink.flush()
    histogram_rows = sum(b.num_rows for b in sent["histograms"])
    assert histogram_rows > 0
    assert f"lost {histogram_rows} TensorBoard histograms" in str(caught.value)
    assert caught.value.rows_lost == 0  # the histograms themselves are in the parts
    (events,) = (tmp_path / "tensorboard").iterdir()
    assert caught.value.paths == (str(events),)
    sink.close()
    assert_final_files_match(tmp_path, sent)


def test_a_failing_histogram_part_is_reported_with_the_rows_it_lost(
    tmp_path: Path, synth: Callable[..., Synth], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A histogram part that cannot be written (a lasting ENOSPC) is reported once, naming the
    part and the histogram rows it lost; the history is untouched."""
    s = synth()
    real = ti_io.write.parts.write_parquet

    def full(path: Path, table: pa.Table) -> None:
        if path.parent.name == "histograms.parts":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, table)

    monkeypatch.setattr(ti_io.write.parts, "write_parquet", full)
    sink, sent = run_sink(tmp_path, s, samples=3, buffer_rows=10_000)
    with pytest.raises(ArtifactWriteError, match="No space left") as caught:
        sink.flush()
    lost = sum(b.num_rows for b in sent["histograms"])
    assert f"lost {lost} histogram rows" in str(caught.value)
    assert caught.value.rows_lost == lost
    assert caught.value.paths == (str(tmp_path / "histograms.parts" / "part-000000.parquet"),)
    sink.close()
    assert_rows_equal(pq.read_table(tmp_path / "history.parquet"), sent["history"])


def test_a_failing_event_file_close_is_reported_at_close(
    tmp_path: Path, synth: Callable[..., Synth], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing the TensorBoard event file failing (EIO) is reported by ``close``, naming the
    file; no row is lost and the run is finalized."""
    s = synth()

    def broken(self: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ti_io.write.parts.EventFileHistograms, "close", broken)
    sink, sent = run_sink(tmp_path, s, samples=3, buffer_rows=10_000)
    (events,) = (tmp_path / "tensorboard").iterdir()
    with pytest.raises(ArtifactWriteError, match="Input/output error") as caught:
        sink.close()
    assert caught.value.paths == (str(events),)
    assert caught.value.rows_lost == 0
    assert "lost no rows" in str(caught.value)
    assert_final_files_match(tmp_path, sent)


def test_a_dead_writer_thread_is_reported_instead_of_waited_for(
    tmp_path: Path, synth: Callable[..., Synth], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should the writer thread end (a fault its own error handling cannot catch), the
    training thread is not blocked forever on a full buffer: it gets an ArtifactWriteError
    saying rows are not being written."""
    s = synth()

    def die(self: object, history: object, histograms: object) -> None:
        raise SystemExit("writer fault")  # ends the thread silently, like an uncatchable fault

    monkeypatch.setattr(ti_io.write.parts.PartWriter, "_publish", die)
    per_sample = s.history(0).num_rows
    sink = DirectorySink(tmp_path, history_config=HistoryConfig(buffer_rows=per_sample))
    sink.open(s.run)
    sink.write_history(s.history(0))  # a full part: the writer takes it and ends
    assert sink._writer is not None
    sink._writer._thread.join(timeout=60)

    def fill() -> None:
        # until the buffer is full
        for sample in range(1, 2 + ti_io.write.parts.BACKPRESSURE_PARTS):
            sink.write_history(s.history(sample))

    with pytest.raises(ArtifactWriteError, match="has stopped; rows are not being written"):
        fill()


def test_a_part_that_fails_once_is_written_again_and_nothing_is_lost(
    tmp_path: Path, synth: Callable[..., Synth], monkeypatch: pytest.MonkeyPatch
) -> None:
    s = synth()
    real = ti_io.write.parts.write_parquet
    failed: list[str] = []

    def transient(path: Path, table: pa.Table) -> None:
        if path.name == "part-000001.parquet" and not failed:
            failed.append(path.name)
            raise OSError(errno.EIO, "Input/output error", str(path))
        real(path, table)

    monkeypatch.setattr(ti_io.write.parts, "write_parquet", transient)
    sink = DirectorySink(tmp_path, history_config=HistoryConfig(flush_seconds=None))
    sink.open(s.run)
    for sample in range(3):
        sink.write_history(s.history(sample))
        sink.flush()  # one part per sample; no error: the retry published part 1
    sink.close()
    assert failed == ["part-000001.parquet"]
    kept = pl.read_parquet(tmp_path / "history.parquet").get_column("sample_id").unique().sort()
    assert kept.to_list() == [0, 1, 2]


def test_deleted_directory_is_reported(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    import shutil

    s = synth()
    out = tmp_path / "stats"
    per_sample = 2 * len(s.run.layers) * len(DEFAULT_METRICS)
    sink = DirectorySink(out, history_config=HistoryConfig(buffer_rows=per_sample))
    sink.open(s.run)
    shutil.rmtree(out)
    sink.write_history(s.history(0))
    with pytest.raises(ArtifactWriteError, match=str(out)):
        sink.flush()
    with pytest.raises(ArtifactWriteError):
        sink.close()
    assert not any(t.name == "ti-io-part-writer" for t in threading.enumerate())


def test_backpressure_blocks_instead_of_dropping(
    tmp_path: Path, synth: Callable[..., Synth], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the writer stuck on its first publication and the buffer full again, write_history
    waits for room (observed, not timed), and every row arrives once the disk frees up."""
    s = synth()
    writing, gate = threading.Event(), threading.Event()
    real = ti_io.write.parts.write_parquet

    def slow(path: Path, table: pa.Table) -> None:
        writing.set()
        gate.wait()
        real(path, table)

    monkeypatch.setattr(ti_io.write.parts, "write_parquet", slow)
    per_sample = s.history(0).num_rows
    sink = DirectorySink(tmp_path, history_config=HistoryConfig(buffer_rows=per_sample))
    sink.open(s.run)
    writer = sink._writer
    assert writer is not None
    returned: list[int] = []
    sent = [s.history(i) for i in range(8)]

    def train() -> None:
        for i, batch in enumerate(sent):
            sink.write_history(batch)
            returned.append(i)

    producer = threading.Thread(target=train)
    producer.start()
    deadline = time.monotonic() + 60  # a deadlock guard, not a timing
    while not (writing.is_set() and writer._buffers["history"].overfull):
        assert time.monotonic() < deadline, "the producer never met a full buffer"
        assert producer.is_alive(), "every write returned although the writer was stuck"
        time.sleep(0.01)
    # The writer holds what it took, BACKPRESSURE_PARTS full parts are buffered, and the call
    # that filled them has not returned.
    assert producer.is_alive()
    assert len(returned) < len(sent)
    gate.set()
    producer.join()
    assert returned == list(range(len(sent)))
    sink.close()
    assert_rows_equal(pq.read_table(tmp_path / "history.parquet"), sent)


def test_several_reasons_are_counted(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    s = synth(empty_every=1)
    sink = DirectorySink(tmp_path)
    sink.open(s.run)
    for sample in range(3):
        batch = s.history(sample)
        if sample == 2:  # a different reason for the last sample's empty gradients
            reasons = [
                None if r is None else "not computed: complex64 dtype"
                for r in batch.column("unavailable_reason").to_pylist()
            ]
            index = batch.schema.get_field_index("unavailable_reason")
            batch = batch.set_column(index, "unavailable_reason", pa.array(reasons))
        sink.write_history(batch)
    sink.close()
    records = load_strict_json(tmp_path / "result.json")
    empty = next(t for t in records[-1]["tensors"] if t["signal"] == "output_gradient")
    assert empty["statistics"]["mean"]["unavailable_reason"] == (
        "all 3 samples unavailable: empty tensor (numel=0) (and 1 other reason; see "
        "unavailable_reason in history.parquet)"
    )


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_hangs_on_the_writers_lock(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    """A fork while another thread holds the writer's lock (the writer taking its buffers):
    the child (a DataLoader worker, say) gets a fresh lock, so a write there returns."""
    s = synth()
    sink = DirectorySink(tmp_path, history_config=HistoryConfig(flush_seconds=None))
    sink.open(s.run)
    writer = sink._writer
    assert writer is not None
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with writer._cond:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(60)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the write returns
        signal.alarm(20)
        try:
            sink.write_history(s.history(0))
        finally:
            os._exit(0)
    release.set()
    holder.join()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), f"the child hung on the lock (status {status})"
    sink.close()
