"""scan_history, consolidate after an interruption, and the `ti` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _fidelity import (
    assert_final_files_match,
    assert_result_json_matches,
    assert_rows_equal,
)
from _io_helpers import Synth, make_run

from ti_io import (
    DirectorySink,
    FinalizationError,
    HistoryConfig,
    NothingToConsolidateError,
    consolidate,
    scan_history,
)
from ti_io.cli import main
from ti_io.read.summary import summary_table
from ti_schema import DEFAULT_METRICS, polars_write_options, validate_result_json
from ti_schema.layout import rank_dir_name
from ti_schema.testing import example_history_table, load_strict_json


def _interrupted(out: Path, s: Synth, samples: int) -> dict[str, list[pa.RecordBatch]]:
    """A run whose process 'died' after publishing its parts: no close, no finalization.
    Returns the batches sent."""
    sink = DirectorySink(out, history_config=HistoryConfig(buffer_rows=40, window=2))
    sink.open(s.run)
    sent: dict[str, list[pa.RecordBatch]] = {"history": [], "histograms": []}
    for i in range(samples):
        sent["history"].append(s.history(i))
        sent["histograms"].append(s.histograms(i))
        sink.write_history(sent["history"][-1])
        sink.write_histograms(sent["histograms"][-1])
    sink._flush_at_exit()  # what the interpreter-exit hook does: parts, no finalization
    return sent


def test_consolidate_recovers_every_row(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    s = synth(empty_every=2)
    sent = _interrupted(tmp_path, s, samples=7)
    rows = 7 * 2 * len(s.run.layers) * len(DEFAULT_METRICS)
    assert not (tmp_path / "history.parquet").exists()
    assert_rows_equal(scan_history(tmp_path).collect().to_arrow(), sent["history"])
    done = consolidate(tmp_path)
    assert (done.history_rows, done.histogram_rows) == (rows, 7 * 2 * len(s.run.focus_layers))
    assert_final_files_match(tmp_path, sent)
    assert not (tmp_path / "history.parts").exists()
    records = load_strict_json(tmp_path / "result.json")
    validate_result_json(records)
    assert [r["layer"] for r in records] == [i.name for i in s.run.layers]  # catalog kept
    # the run's own window (2), numpy over the sent values
    assert_result_json_matches(records, sent["history"], window=2)
    again = consolidate(tmp_path)  # idempotent
    assert again.already_done
    assert again.history_rows == rows


def test_consolidate_refuses_nothing(tmp_path: Path) -> None:
    with pytest.raises(NothingToConsolidateError, match="no TorchInstruments run"):
        consolidate(tmp_path)
    missing = tmp_path / "missing"
    with pytest.raises(NothingToConsolidateError) as caught:
        consolidate(missing)
    assert str(caught.value) == (
        f"consolidate({str(missing)!r}): no such directory; pass the output_dir of a run"
    )
    assert main(["consolidate", str(tmp_path)]) == 1  # the command says so, exit 1


def test_consolidate_checks_history_config(tmp_path: Path) -> None:
    with pytest.raises(TypeError) as caught:
        consolidate(tmp_path, history_config={"window": 3})  # type: ignore[arg-type]
    assert str(caught.value) == (
        "consolidate(history_config=...) takes a ti_io.HistoryConfig, got dict"
    )


def test_consolidate_uses_the_window_it_is_given(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    s = synth()
    sent = _interrupted(tmp_path, s, samples=7)  # written with window 2
    done = consolidate(tmp_path, history_config=HistoryConfig(window=3))
    assert done.history_rows == sum(b.num_rows for b in sent["history"])
    records = load_strict_json(tmp_path / "result.json")
    assert_result_json_matches(records, sent["history"], window=3)
    footer = json.loads(pq.read_schema(tmp_path / "history.parquet").metadata[b"ti"])
    assert footer["window"] == 3


def test_consolidate_of_a_finished_run_reports_it(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    s = synth()
    sent = _interrupted(tmp_path, s, samples=3)
    first = consolidate(tmp_path)
    again = consolidate(tmp_path)
    history_rows = sum(b.num_rows for b in sent["history"])
    histogram_rows = sum(b.num_rows for b in sent["histograms"])
    assert histogram_rows > 0
    assert (first.directory, first.history_rows, first.histogram_rows) == (
        tmp_path,
        history_rows,
        histogram_rows,
    )
    assert first.parts > 0
    assert not first.already_done
    assert again == type(again)(tmp_path, history_rows, histogram_rows, 0, already_done=True)


def test_consolidate_points_at_the_rank_directories(tmp_path: Path) -> None:
    for rank in range(5):
        (tmp_path / rank_dir_name(rank)).mkdir()
    with pytest.raises(NothingToConsolidateError) as caught:
        consolidate(tmp_path)
    assert str(caught.value) == (
        f"{tmp_path} holds rank-private runs (rank-000, rank-001, rank-002, rank-003, ...); "
        f"consolidate each rank directory, e.g. `ti consolidate {tmp_path / 'rank-000'}`"
    )
    (tmp_path / rank_dir_name(4)).rmdir()
    with pytest.raises(NothingToConsolidateError) as caught:
        consolidate(tmp_path)
    assert "(rank-000, rank-001, rank-002, rank-003);" in str(caught.value)  # no "..."


def test_a_finished_run_without_histograms_counts_none(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    s = synth()
    _interrupted(tmp_path, s, samples=2)
    consolidate(tmp_path)
    (tmp_path / "histograms.parquet").unlink()  # e.g. copied without it
    again = consolidate(tmp_path)
    assert again.already_done
    assert again.histogram_rows == 0


def test_an_unreadable_journal_names_the_run_and_the_way_out(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    s = synth()
    _interrupted(tmp_path, s, samples=2)
    (tmp_path / "finalization.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(FinalizationError) as caught:
        consolidate(tmp_path)
    assert caught.value.directory == str(tmp_path)
    assert str(caught.value).startswith(f"cannot resume the finalization of {tmp_path}: ")
    assert "delete it and run `ti consolidate` again" in str(caught.value)


def test_consolidate_refuses_a_live_writer(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    s = synth()
    _interrupted(tmp_path, s, samples=2)
    run_file = tmp_path / "history.parts" / "run.json"
    doc = json.loads(run_file.read_text())
    doc["pid"] = os.getppid()  # a live process other than this one
    run_file.write_text(json.dumps(doc))
    with pytest.raises(RuntimeError) as caught:
        consolidate(tmp_path)
    assert str(caught.value) == (
        f"{tmp_path} is still being written by process {os.getppid()} on this host; remove the "
        "observer in that process (it finalizes the run), or pass force=True (`ti consolidate "
        "--force`) if that process is not the writer any more"
    )
    assert consolidate(tmp_path, force=True).history_rows > 0


def test_scan_history_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such directory"):
        scan_history(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no history"):
        scan_history(tmp_path)


def test_cli_validate_summary_consolidate(
    tmp_path: Path, synth: Callable[..., Synth], capsys: pytest.CaptureFixture[str]
) -> None:
    s = synth()
    _interrupted(tmp_path, s, samples=3)
    assert main(["summary", str(tmp_path), "--metric", "mean"]) == 0  # live parts
    live = capsys.readouterr().out
    assert "live or unconsolidated" in live
    assert "encoder.0" in live
    assert main(["validate", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "ok"
    assert main(["consolidate", str(tmp_path)]) == 0
    assert "consolidated" in capsys.readouterr().out
    assert main(["validate", str(tmp_path)]) == 0
    capsys.readouterr()
    # Break result.json (a NaN token) and history (an extra column): both are listed.
    text = (tmp_path / "result.json").read_text()
    (tmp_path / "result.json").write_text(text.replace('"unavailable": 0', '"unavailable": NaN', 1))
    pl.read_parquet(tmp_path / "history.parquet").with_columns(extra=pl.lit(1)).write_parquet(
        tmp_path / "history.parquet"
    )
    assert main(["validate", str(tmp_path)]) == 1
    report = capsys.readouterr().out
    assert "result.json: not strict JSON" in report
    assert "'extra'" in report


def test_cli_validate_reads_footers_and_checks_rank_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for rank in (0, 1):  # the synthetic rows all say rank 0
        run = make_run(rank_subdir=rank_dir_name(rank))
        s = Synth(run)
        sink = DirectorySink(tmp_path)
        sink.open(run)
        sink.write_history(s.history(0))
        sink.close()
    # Rewritten by Polars as the contract says (polars_write_options): `ti` only in the footer.
    history = tmp_path / "rank-000" / "history.parquet"
    schema = pq.read_schema(history)
    pl.read_parquet(history).write_parquet(history, **polars_write_options(schema))
    assert b"ti" not in (pq.read_table(history).schema.metadata or {})
    assert main(["validate", str(tmp_path)]) == 1
    report = capsys.readouterr().out
    assert report.splitlines()[0] == f"{tmp_path}: 1 problem(s)"
    assert "rank-001/history.parquet: sits in rank-001/ but holds rank values [0]" in report


def test_cli_escapes_names_in_the_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run((("evil\n\x1b[31mred", "Linear"), ("", "Model")))
    s = Synth(run)
    sink = DirectorySink(tmp_path)
    sink.open(run)
    sink.write_history(s.history(0))
    sink.close()
    assert main(["summary", str(tmp_path), "--metric", "max", "--signal", "output"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "evil\\n\\u001b[31mred" in out
    assert "(root)" in out


def test_finalize_streams_parts_into_bounded_row_groups(
    tmp_path: Path, synth: Callable[..., Synth], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    consolidate_module = sys.modules["ti_io.finish.consolidate"]
    monkeypatch.setattr(consolidate_module, "ROW_GROUP_ROWS", 100)
    s = synth(empty_every=5)
    sink = DirectorySink(tmp_path, history_config=HistoryConfig(buffer_rows=36, window=2))
    sink.open(s.run)
    for i in range(20):
        sink.write_history(s.history(i))
    sink.flush()
    parts = sorted((tmp_path / "history.parts").glob("part-*.parquet"))
    in_parts = pa.concat_tables(pq.read_table(p) for p in parts)
    sink.close()
    final = pq.ParquetFile(tmp_path / "history.parquet")
    sizes = [final.metadata.row_group(i).num_rows for i in range(final.num_row_groups)]
    assert len(sizes) > 1
    assert max(sizes) <= 100
    assert final.read().equals(in_parts)  # same rows, same order as the parts


def test_final_files_read_back_exactly_as_parts_written_from_strings(
    tmp_path: Path, synth: Callable[..., Synth], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finalization writes the strings dictionary-encoded and records the contract's schema in
    the footer itself: the files must read back as if plain strings had been written (the
    parts were, by pq.write_table)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ti_schema import validate_histograms, validate_history

    consolidate_module = sys.modules["ti_io.finish.consolidate"]
    monkeypatch.setattr(consolidate_module, "ROW_GROUP_ROWS", 30)  # several row groups
    s = synth(empty_every=3)
    sink = DirectorySink(tmp_path, history_config=HistoryConfig(buffer_rows=36, window=2))
    sink.open(s.run)
    for i in range(12):
        sink.write_history(s.history(i, dictionary=i % 2 == 0))
        sink.write_histograms(s.histograms(i))
    sink.flush()
    written = {}
    for name in ("history", "histograms"):
        parts = sorted((tmp_path / f"{name}.parts").glob("part-*.parquet"))
        written[name] = (
            pq.ParquetFile(parts[0]),
            pa.concat_tables(pq.read_table(p) for p in parts),
        )
    sink.close()
    for name, (part, rows) in written.items():
        final = pq.ParquetFile(tmp_path / f"{name}.parquet")
        assert final.metadata.num_row_groups > 1
        assert final.metadata.metadata == part.metadata.metadata  # ARROW:schema and ti
        assert final.schema.equals(part.schema)  # Parquet types
        assert final.schema_arrow.equals(part.schema_arrow, check_metadata=True)
        table = final.read()
        assert table.equals(rows, check_metadata=True)
        assert not any(pa.types.is_dictionary(f.type) for f in table.schema)
        (validate_history if name == "history" else validate_histograms)(table)


def test_digest_groups_dictionary_encoded_rows_like_plain_strings() -> None:
    """Row groups of dictionary-encoded strings (several dictionaries, or one that repeats a
    value) give the digest of the same rows as plain strings."""
    import pyarrow as pa
    from polars.testing import assert_frame_equal

    from ti_io.finish.digest import HistoryDigest
    from ti_io.read.ordering import GROUP_KEYS
    from ti_schema.testing import example_history_table

    plain = example_history_table(540)
    encoded = example_history_table(540, dictionary=True)
    layer = plain.schema.get_field_index("layer")
    # One dictionary naming each layer twice; odd samples use the second copy.
    names = plain.column(layer).to_pylist()
    samples = plain.column("sample_id").to_pylist()
    dictionary = sorted(set(names))
    indices = [
        dictionary.index(n) + len(dictionary) * (s % 2) for n, s in zip(names, samples, strict=True)
    ]
    repeated = pa.DictionaryArray.from_arrays(pa.array(indices, pa.int32()), dictionary * 2)
    repeats = plain.set_column(
        layer, plain.schema.field(layer).with_type(repeated.type), [repeated]
    )

    def digest(tables: list[pa.Table]) -> HistoryDigest:
        result = HistoryDigest()
        for table in tables:
            result.add(table)
        return result

    reference = digest([plain.slice(0, 200), plain.slice(200)])
    for tables in (
        [pa.concat_tables([encoded.slice(0, 100), encoded.slice(100, 100)]), encoded.slice(200)],
        [repeats.slice(0, 200), repeats.slice(200)],
    ):
        candidate = digest(tables)
        for window in (2, 5):
            expected = reference.aggregated(window).drop("key").sort(GROUP_KEYS)
            assert_frame_equal(candidate.aggregated(window).drop("key").sort(GROUP_KEYS), expected)
        assert candidate.facts(3) == reference.facts(3)


def test_the_ti_command_does_not_import_torch() -> None:
    code = "import sys, ti_io.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"  # `ti validate` starts in about a second, not ten


def test_cli_summary_of_a_finalized_run_lists_metrics_in_contract_order(
    tmp_path: Path, synth: Callable[..., Synth], capsys: pytest.CaptureFixture[str]
) -> None:
    s = synth()
    _interrupted(tmp_path, s, samples=2)
    assert main(["consolidate", str(tmp_path)]) == 0  # finalized: run.json is gone
    capsys.readouterr()
    assert main(["summary", str(tmp_path), "--signal", "output"]) == 0
    out = capsys.readouterr().out
    body = out.split("╞", 1)[1]  # skip the header, whose column names repeat metric names
    cells = [c.strip() for line in body.splitlines() for c in line.split("┆")]
    first_tensor = [c for c in cells if c in DEFAULT_METRICS][: len(DEFAULT_METRICS)]
    assert first_tensor == list(DEFAULT_METRICS)


def test_cli_summary_uses_the_window_the_run_was_written_with(
    tmp_path: Path, synth: Callable[..., Synth], capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's window (2) holds live (run.json) and after finalization (the history footer),
    and 7 observations give a recent window mean, not a null for lack of 20."""
    s = synth(seed=5)
    sent = _interrupted(tmp_path, s, samples=7)  # HistoryConfig(window=2)
    values = np.array(
        [
            row["value"]
            for batch in sent["history"]
            for row in batch.to_pylist()
            if (row["layer"], row["signal"], row["metric"])
            == (s.run.layers[0].name, "output", "std")
        ]
    )
    assert len(values) == 7
    for state in ("live", "finalized"):
        if state == "finalized":
            assert main(["consolidate", str(tmp_path)]) == 0
            assert not (tmp_path / "history.parts").exists()
        table = summary_table(tmp_path, ["std"], ["output"])
        recent = table.filter(pl.col("layer") == s.run.layers[0].name).item(0, "recent_window_mean")
        assert recent == pytest.approx(values[-2:].mean(), rel=1e-12), state
        assert main(["summary", str(tmp_path), "--metric", "std"]) == 0
        assert "window 2" in capsys.readouterr().out


def test_a_process_that_exits_without_close_publishes_its_rows_and_ends(tmp_path: Path) -> None:
    """An interpreter exit without ``close`` neither hangs on the writer thread (a daemon) nor
    loses the buffered rows: the exit flush publishes them as parts, which consolidate."""
    code = (
        "import sys\n"
        "from ti_io import DirectorySink, HistoryConfig\n"
        "from ti_schema.testing import example_history_table, example_run_info\n"
        "sink = DirectorySink(sys.argv[1], history_config=HistoryConfig(buffer_rows=10_000))\n"
        "sink.open(example_run_info())\n"
        "for batch in example_history_table().to_batches():\n"
        "    sink.write_history(batch)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    sent = example_history_table()
    assert sent.num_rows > 0
    parts = sorted((tmp_path / "history.parts").glob("*.parquet"))
    assert_rows_equal(pa.concat_tables(pq.read_table(p) for p in parts), sent.to_batches())
    assert main(["consolidate", str(tmp_path)]) == 0
    assert_rows_equal(pq.read_table(tmp_path / "history.parquet"), sent.to_batches())
