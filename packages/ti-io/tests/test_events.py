"""The flight recorder's ``ti.events`` table in ti-io: parts published at once, events.parquet
at finalization, result.json / index.md / ``ti summary`` / ``ti compare`` / ``ti validate`` /
``ti upgrade``, and the readers (torch-free: the batches are built with ti-schema)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _event_helpers import event_batch
from _io_helpers import Synth, make_run

from ti_io import DirectorySink, consolidate, read_events, scan_events
from ti_io.cli import main
from ti_io.finish.journal import FinalizationState, read_journal
from ti_schema import (
    EVENT_COLUMNS,
    RESULT_JSON_SCHEMA,
    events_schema,
    validate_events,
    validate_result_json,
)
from ti_schema.artifacts import artifact_dir_problems
from ti_schema.layout import EVENT_PARTS, EVENTS_FILE, HISTORY_PARTS, JOURNAL_FILE, list_parts
from ti_schema.testing import assert_artifact_dir_conforms

SAMPLES = 8


def _open_run(
    directory: Path, synth: Callable[..., Synth], samples: int = SAMPLES
) -> DirectorySink:
    synthetic = synth()
    sink = DirectorySink(directory)
    sink.open(synthetic.run)
    for sample in range(samples):
        sink.write_history(synthetic.history(sample))
        sink.write_histograms(synthetic.histograms(sample))
    return sink


def _events(*batches: pa.RecordBatch) -> pa.Table:
    return pa.Table.from_batches(list(batches)).cast(events_schema())


NONFINITE = event_batch(0, forward_index=4, layers=("encoder.1", "encoder.0"), dense_forwards=3)
MANUAL = event_batch(1, kind="manual", forward_index=9, reason="look <here> & now", seconds=2)
LOSS = event_batch(2, kind="loss", forward_index=11, value=float("inf"), reason="loss spike")


def test_the_sink_declares_write_events_and_publishes_each_event_at_once(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    sink = _open_run(tmp_path, synth)
    write_events = sink.capabilities().write_events
    assert write_events is not None
    assert list_parts(tmp_path / EVENT_PARTS) == []
    write_events(NONFINITE)
    # On disk before the call returned: no flush clock, no close.
    (part,) = list_parts(tmp_path / EVENT_PARTS)
    assert pq.read_table(part).select(list(EVENT_COLUMNS)).equals(_events(NONFINITE))
    validate_events(pq.read_table(part), metadata=pq.read_metadata(part).metadata)
    write_events(MANUAL)
    assert [p.name for p in list_parts(tmp_path / EVENT_PARTS)] == [
        "part-000000.parquet",
        "part-000001.parquet",
    ]
    live = read_events(tmp_path)
    assert live.column("event_id").to_pylist() == [0, 1]
    assert artifact_dir_problems(tmp_path, allow_live=True) == []
    sink.close()


def test_finalization_writes_events_parquet_and_retires_the_parts(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    sink = _open_run(tmp_path, synth)
    for batch in (NONFINITE, MANUAL, LOSS):
        sink.write_events(batch)
    sink.close()
    assert not (tmp_path / EVENT_PARTS).exists()
    table = pq.read_table(tmp_path / EVENTS_FILE)
    validate_events(table, metadata=pq.read_metadata(tmp_path / EVENTS_FILE).metadata)
    assert table.equals(_events(NONFINITE, MANUAL, LOSS).cast(table.schema))
    assert pq.ParquetFile(tmp_path / EVENTS_FILE).metadata.row_group(0).column(0).compression == (
        "ZSTD"
    )
    assert read_events(tmp_path).num_rows == 3
    frame = scan_events(tmp_path).collect()
    assert frame.get_column("kind").to_list() == ["nonfinite", "manual", "loss"]
    assert frame.get_column("layers").to_list()[0] == ["encoder.1", "encoder.0"]
    assert_artifact_dir_conforms(tmp_path)


def test_a_run_without_events_has_an_empty_table_not_a_missing_file(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    _open_run(tmp_path, synth).close()
    table = pq.read_table(tmp_path / EVENTS_FILE)
    assert table.num_rows == 0
    assert table.schema.names == list(EVENT_COLUMNS)
    validate_events(table, metadata=pq.read_metadata(tmp_path / EVENTS_FILE).metadata)
    assert scan_events(tmp_path).collect().height == 0
    records = json.loads((tmp_path / "result.json").read_text())
    assert all("events" not in record for record in records)
    index = (tmp_path / "index.md").read_text()
    assert "## Events\n\nNone:" in index


def test_bad_event_batches_are_refused_naming_the_argument(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    sink = _open_run(tmp_path, synth, samples=1)
    with pytest.raises(TypeError, match=r"write_events\(batch\) takes a pyarrow.RecordBatch"):
        sink.write_events(_events(NONFINITE))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"build batches with ti_schema\.events_schema"):
        sink.write_events(NONFINITE.drop_columns(["reason"]))
    no_module = NONFINITE.set_column(
        NONFINITE.schema.get_field_index("layer"), "layer", pa.array([None], pa.string())
    )
    with pytest.raises(ValueError, match="name no signal or no first module"):
        sink.write_events(no_module)
    assert list_parts(tmp_path / EVENT_PARTS) == []  # nothing written
    sink.close()
    with pytest.raises(RuntimeError, match="write_events called after close"):
        sink.write_events(NONFINITE)


def test_result_json_lists_each_event_under_its_first_module(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    sink = _open_run(tmp_path, synth)
    for batch in (NONFINITE, MANUAL, LOSS):
        sink.write_events(batch)
    sink.close()
    records = json.loads((tmp_path / "result.json").read_text())
    validate_result_json(records)
    by_layer = {r["layer"]: r for r in records}
    assert "events" not in by_layer["encoder.0"]
    (event,) = by_layer["encoder.1"]["events"]
    assert event == {
        "kind": "nonfinite",
        "forward_index": 4,
        "signal": "output",
        "layer": "encoder.1",
        "module_type": "ReLU",
        "tensor_path": "",
        "layers": ["encoder.1", "encoder.0"],
        "rank": 0,
        "timestamp": "2026-01-01T00:00:00+00:00",
        "reason": None,
        "value": None,
        "dense_first_forward": 5,
        "dense_forwards": 3,
    }
    assert list(event) == list(RESULT_JSON_SCHEMA["$defs"]["event"]["required"])
    # The key is optional but validated.
    broken = json.loads(json.dumps(records))
    broken[1]["events"][0]["kind"] = "panic"
    broken[1]["events"][0]["dense_forwards"] = -1
    del broken[1]["events"][0]["rank"]
    with pytest.raises(ValueError, match=r"result\.json") as error:
        validate_result_json(broken)
    text = str(error.value)
    assert "$[1].events[0].kind" in text
    assert "$[1].events[0].dense_forwards" in text
    assert "$[1].events[0].rank: is missing" in text


def test_index_md_lists_events_first_with_queries_that_select_the_dense_samples(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    sink = _open_run(tmp_path, synth, samples=SAMPLES)
    for batch in (NONFINITE, MANUAL):
        sink.write_events(batch)
    sink.close()
    index = (tmp_path / "index.md").read_text()
    assert index.index("## Events") < index.index("## Run") < index.index("## Layers")
    assert 'first module: "encoder.1" (type "ReLU"' in index
    assert 'flagged, in execution order: ["encoder.1", "encoder.0"]' in index
    assert "dense capture: forwards 5 .. 7 (3 root forwards" in index
    assert r'reason: "look \u003chere\u003e \u0026 now"' in index  # no markup survives
    block = index.split("Their dense samples (Python, Polars):\n\n```python\n", 1)[1]
    code = block.split("```", 1)[0]
    namespace: dict[str, object] = {}
    exec(compile(code, "index.md", "exec"), namespace)
    history = pq.read_table(tmp_path / "history.parquet").to_pydict()
    forwards = np.asarray(history["forward_index"])
    for name, (low, high) in (("dense_0", (5, 7)), ("dense_1", (10, 13))):
        dense = namespace[name]
        assert isinstance(dense, pl.DataFrame)
        expected = int(((forwards >= low) & (forwards <= high)).sum())
        assert dense.height == expected
        assert dense.get_column("forward_index").is_between(low, high).all()
    # Synth samples sit at forward 2 * sample: 6 in the first range, 10 and 12 in the second.
    assert sorted(set(namespace["dense_0"]["forward_index"].to_list())) == [6]  # type: ignore[index]
    assert sorted(set(namespace["dense_1"]["forward_index"].to_list())) == [10, 12]  # type: ignore[index]
    first = namespace["first_module_0"]
    assert isinstance(first, pl.DataFrame)
    assert first.height == SAMPLES * 2


def test_ti_summary_prints_the_events_above_its_table(
    tmp_path: Path, synth: Callable[..., Synth], capsys: pytest.CaptureFixture[str]
) -> None:
    sink = _open_run(tmp_path, synth)
    sink.write_events(NONFINITE)
    sink.write_events(MANUAL)
    sink.flush()
    # Live: read from the parts.
    assert main(["summary", str(tmp_path)]) == 0
    live = capsys.readouterr().out.splitlines()
    sink.close()
    assert main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    for lines in (live, out):
        lines = [line for line in lines if not line.startswith("telemetry cost:")]
        assert lines[1] == "2 event(s) (events.parquet; ti_io.read_events):"
        assert lines[2] == (
            "  nonfinite at forward 4, signal output, first module encoder.1 (ReLU), 1 more "
            "flagged, rank 0, dense forwards 5..7"
        )
        assert lines[3].startswith('  manual at forward 9, reason "look <here> & now", rank 0')
        assert "layer" in lines[4] or "layer" in lines[5]  # the table follows
    # --csv / --json: the table alone.
    assert main(["summary", str(tmp_path), "--csv"]) == 0
    assert "event" not in capsys.readouterr().out.splitlines()[0]


def test_ti_compare_shows_each_runs_event_count_and_first_event(
    tmp_path: Path, synth: Callable[..., Synth], capsys: pytest.CaptureFixture[str]
) -> None:
    quiet, broken = tmp_path / "quiet", tmp_path / "broken"
    _open_run(quiet, synth).close()
    sink = _open_run(broken, synth)
    sink.write_events(NONFINITE)
    sink.write_events(MANUAL)
    sink.close()
    assert main(["compare", str(quiet), str(broken), "--metric", "mean"]) == 0
    out = capsys.readouterr().out.splitlines()
    quiet_line = next(line for line in out if line.strip().startswith("quiet"))
    broken_index = next(i for i, line in enumerate(out) if line.strip().startswith("broken"))
    assert quiet_line.endswith("0 event(s))")
    assert out[broken_index].endswith("2 event(s))")
    assert (
        out[broken_index + 1]
        .strip()
        .startswith("first event: nonfinite at forward 4, signal output, first module encoder.1")
    )


def test_ti_validate_checks_events_parquet_and_parts(
    tmp_path: Path, synth: Callable[..., Synth], capsys: pytest.CaptureFixture[str]
) -> None:
    sink = _open_run(tmp_path, synth)
    sink.write_events(NONFINITE)
    sink.flush()
    # A part of another writer that breaks the contract: a kind nobody knows.
    bad = _events(NONFINITE).set_column(3, "kind", pa.array(["panic"], pa.string()))
    pq.write_table(
        bad.cast(events_schema("someone else")), tmp_path / EVENT_PARTS / "part-000007.parquet"
    )
    assert main(["validate", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "part-000007.parquet" in out
    assert "'kind'" in out
    assert "panic" in out
    (tmp_path / EVENT_PARTS / "part-000007.parquet").unlink()
    assert main(["validate", str(tmp_path)]) == 0
    capsys.readouterr()
    sink.close()
    assert main(["validate", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "ok"
    # An events.parquet whose rows sit in the wrong rank directory is reported too.
    table = pq.read_table(tmp_path / EVENTS_FILE)
    rank = table.schema.get_field_index("rank")
    pq.write_table(
        table.set_column(rank, table.schema.field(rank), pa.array([3], pa.int32())),
        tmp_path / EVENTS_FILE,
    )
    assert main(["validate", str(tmp_path)]) == 0  # a plain run: any rank is allowed


def test_consolidate_recovers_every_event_and_resumes_a_journaled_finalization(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    sink = _open_run(tmp_path, synth)
    sink.write_events(NONFINITE)
    sink.write_events(MANUAL)
    sink.flush()
    # The process "dies" here: no close. The parts are the run.
    assert read_events(tmp_path).num_rows == 2
    done = consolidate(tmp_path, force=True)
    assert done.history_rows > 0
    assert not (tmp_path / EVENT_PARTS).exists()
    assert read_events(tmp_path).column("kind").to_pylist() == ["nonfinite", "manual"]
    assert_artifact_dir_conforms(tmp_path)
    sink._closed = True  # the "dead" process never closes; its writer thread is stopped below
    assert sink._writer is not None
    sink._writer.stop()


def test_a_finalization_stopped_after_written_keeps_event_parts_until_events_parquet_holds_them(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    sink = _open_run(tmp_path, synth)
    sink.write_events(NONFINITE)
    sink.close()
    # Rebuild the state of a finalization killed in `written` before events.parts/ was retired,
    # with events.parquet lost: the journal step must refuse to retire the event parts.
    from ti_io.finish.journal import Journal

    part_dir = tmp_path / EVENT_PARTS
    part_dir.mkdir()
    pq.write_table(_events(NONFINITE).cast(events_schema("t")), part_dir / "part-000000.parquet")
    (tmp_path / HISTORY_PARTS).mkdir()
    history_rows = pq.read_metadata(tmp_path / "history.parquet").num_rows
    histogram_rows = pq.read_metadata(tmp_path / "histograms.parquet").num_rows
    journal = Journal(FinalizationState.WRITTEN, 1, "host", history_rows, histogram_rows)
    (tmp_path / JOURNAL_FILE).write_text(journal.to_json())
    events_file = (tmp_path / EVENTS_FILE).read_bytes()
    (tmp_path / EVENTS_FILE).unlink()
    with pytest.raises(Exception, match=re.escape(f"{EVENT_PARTS}/ holds 1 event rows")):
        consolidate(tmp_path)
    assert list_parts(part_dir)  # kept
    (tmp_path / EVENTS_FILE).write_bytes(events_file)
    done = consolidate(tmp_path)
    assert done.resumed_from == "written"
    assert not part_dir.exists()
    assert read_journal(tmp_path) is None
    assert read_events(tmp_path).num_rows == 1


def test_upgrade_of_a_0_8_0_run_writes_an_empty_events_table(tmp_path: Path) -> None:
    from test_legacy_runs import write_legacy_run

    old, new = tmp_path / "old", tmp_path / "new"
    write_legacy_run(old, samples=3, window=20)
    assert main(["upgrade", str(old), str(new)]) == 0
    table = pq.read_table(new / EVENTS_FILE)
    assert table.num_rows == 0
    validate_events(table, metadata=pq.read_metadata(new / EVENTS_FILE).metadata)
    assert_artifact_dir_conforms(new)
    assert "## Events\n\nNone:" in (new / "index.md").read_text()


def test_scan_events_of_a_directory_without_a_run_names_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="holds no run"):
        scan_events(tmp_path)
    (tmp_path / "rank-000").mkdir()
    (tmp_path / "rank-000" / HISTORY_PARTS).mkdir()
    with pytest.raises(FileNotFoundError, match=r"ti_dist\.events_across_ranks"):
        read_events(tmp_path)
    assert read_events(tmp_path / "rank-000").num_rows == 0  # a run without events.parts/


def test_overwrite_removes_a_previous_runs_event_parts(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    sink = _open_run(tmp_path, synth, samples=1)
    sink.write_events(NONFINITE)
    sink._closed = True
    assert sink._writer is not None
    sink._writer.stop()  # killed: parts left
    again = DirectorySink(tmp_path, overwrite=True)
    again.open(make_run())
    assert list_parts(tmp_path / EVENT_PARTS) == []
    again.close()
    assert read_events(tmp_path).num_rows == 0


def test_events_of_contract_1_4_read_with_null_replay_columns(tmp_path: Path) -> None:
    """A run finalized before contract 1.5 has no ``replay`` / ``replay_reason``: its events
    read with nulls there, its result.json events without the keys, and it validates."""
    batch = event_batch(0, replay="reproduced", replay_reason="made by encoder.1")
    old = pa.Table.from_batches([batch]).drop_columns(["replay", "replay_reason"])
    doc = json.loads(old.schema.metadata[b"ti"])
    doc["schema_version"] = "1.4"
    old = old.replace_schema_metadata({b"ti": json.dumps(doc).encode()})
    run = tmp_path / "run"
    (run / EVENT_PARTS).mkdir(parents=True)
    (run / HISTORY_PARTS).mkdir()
    pq.write_table(old, run / EVENT_PARTS / "part-000000.parquet")
    events = read_events(run)
    assert events.column("replay").to_pylist() == [None]
    assert events.column("replay_reason").to_pylist() == [None]
    assert events.column("layer").to_pylist() == ["encoder.1"]
    from ti_io.read.events import describe_event, event_records

    record = event_records(events)[0]
    assert "replay" not in record
    assert "replay" not in describe_event(record)
    fresh = event_records(pa.Table.from_batches([batch]))[0]
    assert (fresh["replay"], fresh["replay_reason"]) == ("reproduced", "made by encoder.1")
    assert "replay reproduced (made by encoder.1)" in describe_event(fresh)
    validate_events(old, metadata=old.schema.metadata)
