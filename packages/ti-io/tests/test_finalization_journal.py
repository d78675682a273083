"""The finalization journal: every state an interrupted finalization can leave resumes to the
files an uninterrupted one writes, and a finished history is never replaced by a smaller one.

The states are built here the way the writer builds them (the final files from the parts, the
journal published, parts directories renamed away); tests/test_reliability_finalization.py
reaches each of them by killing a real finalization after every file operation.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from _io_helpers import Synth, interrupted_run

from ti_io import consolidate
from ti_io.cli import main
from ti_io.errors import FinalizationBusyError, FinalizationError, ShrinkRefusedError
from ti_io.facts import read_run_facts
from ti_io.finish.consolidate import _write_final_files
from ti_io.finish.journal import FinalizationState, Journal, read_journal
from ti_io.publishing import publish_text, temp_path
from ti_schema.artifacts import artifact_dir_problems
from ti_schema.layout import HISTOGRAM_PARTS, HISTORY_PARTS, JOURNAL_FILE, part_name

FINAL = ("history.parquet", "histograms.parquet", "result.json", "index.md")


def _reference(run: Path, where: Path) -> dict[str, bytes | object]:
    """What an uninterrupted consolidation of a copy of ``run`` writes."""
    shutil.copytree(run, where)
    consolidate(where)
    return _finished(where)


def _finished(run: Path) -> dict[str, bytes | object]:
    """The content of a finalized run (tables compared as tables, text files as bytes), after
    checking that nothing of the finalization is left behind."""
    assert not (run / JOURNAL_FILE).exists()
    assert not (run / HISTORY_PARTS).exists()
    assert not (run / HISTOGRAM_PARTS).exists()
    assert not [p.name for p in run.iterdir() if p.name.endswith(".ti-tmp")]
    assert artifact_dir_problems(run) == []
    return {
        "history": pq.read_table(run / "history.parquet"),
        "histograms": pq.read_table(run / "histograms.parquet"),
        "result.json": (run / "result.json").read_bytes(),
        # index.md names the directory it is in (its queries run as they are)
        "index.md": (run / "index.md").read_text().replace(str(run), "RUN"),
    }


def _journal(run: Path, state: FinalizationState, rows: tuple[int, int] | None = None) -> None:
    history_rows, histogram_rows = rows if rows is not None else (None, None)
    journal = Journal(state, 12345, "elsewhere", history_rows, histogram_rows)
    publish_text(run / JOURNAL_FILE, journal.to_json())


def _retire(run: Path, name: str) -> Path:
    """Rename a parts directory away, as a retirement does first."""
    retired = temp_path(run / name)
    os.replace(run / name, retired)
    return retired


def test_the_issue_state_finishes_without_touching_the_history(
    tmp_path: Path, synth: Callable[..., Synth], capsys: pytest.CaptureFixture[str]
) -> None:
    # ti-io before the journal: the final files written, history.parts/ retired, then the
    # process died before retiring histograms.parts/. `ti consolidate` then rebuilt the history
    # from zero parts ("consolidated 51 parts into 0 history rows"): the bug this test pins.
    run = interrupted_run(tmp_path / "run", synth())
    want = _reference(run, tmp_path / "reference")
    _write_final_files(run, read_run_facts(run))
    shutil.rmtree(_retire(run, HISTORY_PARTS))
    history = (run / "history.parquet").read_bytes()
    assert main(["consolidate", str(run)]) == 0
    out = capsys.readouterr().out
    assert "resumed the interrupted finalization (journal state 'written')" in out
    assert f"{want['history'].num_rows} history rows" in out  # type: ignore[attr-defined]
    assert (run / "history.parquet").read_bytes() == history  # kept, never rewritten
    assert _finished(run) == want


def test_a_finished_history_is_never_replaced_by_a_smaller_one(
    tmp_path: Path, synth: Callable[..., Synth], capsys: pytest.CaptureFixture[str]
) -> None:
    s = synth()
    run = interrupted_run(tmp_path / "run", s)
    consolidate(run)
    history = (run / "history.parquet").read_bytes()
    rows = pq.read_metadata(run / "history.parquet").num_rows
    (run / HISTORY_PARTS).mkdir()  # parts reappear, holding less than the finished file
    pq.write_table(
        pq.read_table(run / "history.parquet").slice(0, 10), run / HISTORY_PARTS / part_name(0)
    )
    with pytest.raises(ShrinkRefusedError) as refused:
        consolidate(run)
    message = str(refused.value)
    assert f"history.parquet holds {rows} rows and history.parts/ only 10" in message
    assert "never replaced by a smaller one" in message
    assert (run / "history.parquet").read_bytes() == history
    assert not (run / JOURNAL_FILE).exists()  # refused before anything was changed
    assert main(["consolidate", str(run)]) == 1
    assert "never replaced by a smaller one" in capsys.readouterr().err


@pytest.mark.parametrize("written", [1, 4])
def test_resume_from_writing_rewrites_every_file_from_the_parts(
    tmp_path: Path, synth: Callable[..., Synth], written: int
) -> None:
    run = interrupted_run(tmp_path / "run", synth(empty_every=2))
    want = _reference(run, tmp_path / "reference")
    live = {name: (run / name).read_bytes() for name in ("result.json", "index.md")}
    _journal(run, FinalizationState.WRITING)
    _write_final_files(run, read_run_facts(run))
    if written == 1:
        # killed while streaming histograms.parquet: history.parquet published, a temporary
        # left over, result.json and index.md still those of the live run
        (run / "histograms.parquet").unlink()
        temp_path(run / "histograms.parquet").write_bytes(b"PAR1 half a file")
        for name, content in live.items():
            (run / name).write_bytes(content)
    # written == 4: killed after the four files, before recording it
    done = consolidate(run)
    assert done.resumed_from == "writing"
    assert _finished(run) == want


def test_resume_from_written_retires_what_is_left(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    run = interrupted_run(tmp_path / "run", synth())
    want = _reference(run, tmp_path / "reference")
    rows = _write_final_files(run, read_run_facts(run))
    _journal(run, FinalizationState.WRITTEN, rows)
    retired = _retire(run, HISTORY_PARTS)  # killed after the first rename of the retirement
    (retired / "run.json").unlink()  # and while emptying it
    done = consolidate(run)
    assert (done.resumed_from, done.parts) == ("written", 0)
    assert (done.history_rows, done.histogram_rows) == rows
    assert not retired.exists()
    assert _finished(run) == want


def test_a_final_file_changed_since_it_was_written_stops_the_retirement(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    run = interrupted_run(tmp_path / "run", synth())
    rows = _write_final_files(run, read_run_facts(run))
    _journal(run, FinalizationState.WRITTEN, rows)
    history = pq.read_table(run / "history.parquet")
    pq.write_table(history.slice(0, 5), run / "history.parquet")
    with pytest.raises(ShrinkRefusedError, match=f"wrote {rows[0]} rows to history.parquet"):
        consolidate(run)
    assert pq.read_table(run / HISTORY_PARTS / part_name(0)).num_rows > 0  # parts kept
    journal = read_journal(run)
    assert journal is not None
    assert journal.state is FinalizationState.WRITTEN


def test_a_journal_that_cannot_be_read_is_reported_not_guessed(
    tmp_path: Path, synth: Callable[..., Synth], capsys: pytest.CaptureFixture[str]
) -> None:
    run = interrupted_run(tmp_path / "run", synth())
    (run / JOURNAL_FILE).write_text('{"format": "ti.finalization", "version": 1, "state": "?"}')
    with pytest.raises(FinalizationError, match="unknown state '\\?'"):
        consolidate(run)
    assert main(["validate", str(run)]) == 1
    assert "unknown state '?' (known: writing, written)" in capsys.readouterr().out
    (run / JOURNAL_FILE).write_text("{")
    with pytest.raises(FinalizationError, match="is not JSON") as caught:
        consolidate(run)
    assert "delete it and run `ti consolidate` again" in str(caught.value)


def test_ti_validate_accepts_an_interrupted_finalization_and_says_how_to_finish_it(
    tmp_path: Path, synth: Callable[..., Synth], capsys: pytest.CaptureFixture[str]
) -> None:
    run = interrupted_run(tmp_path / "run", synth())
    _journal(run, FinalizationState.WRITING)
    assert main(["validate", str(run)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "ok\n"
    assert f"interrupted after the step 'writing' ({JOURNAL_FILE}); `ti consolidate {run}`" in (
        captured.err
    )
    assert [p.path.name for p in artifact_dir_problems(run)] == [JOURNAL_FILE, "history.parquet"]


def test_one_finalizer_at_a_time(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    run = interrupted_run(tmp_path / "run", synth())
    _journal(run, FinalizationState.WRITING)
    fd = os.open(run, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another finalizer at work
        with pytest.raises(FinalizationBusyError, match="process 12345 on elsewhere"):
            consolidate(run)
        assert main(["consolidate", str(run)]) == 1
    finally:
        os.close(fd)
    assert consolidate(run).resumed_from == "writing"


def test_a_journal_means_the_writer_has_stopped(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    # run.json names a live writer (this test's parent process), but the journal says that
    # writer already finished writing parts and began finalizing: resuming needs no --force.
    import json

    run = interrupted_run(tmp_path / "run", synth())
    run_file = run / HISTORY_PARTS / "run.json"
    doc = json.loads(run_file.read_text())
    doc["pid"] = os.getppid()
    run_file.write_text(json.dumps(doc))
    with pytest.raises(RuntimeError, match="still being written"):
        consolidate(run)
    _journal(run, FinalizationState.WRITING)
    assert consolidate(run).resumed_from == "writing"
