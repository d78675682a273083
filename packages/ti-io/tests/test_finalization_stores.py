"""One finalization over both stores: every state an interrupted finalization can leave, built
once as a local directory and then either kept there or uploaded to a moto S3 server, finishes
to the same final files (or is refused with the same message) on both.

The state machine (ti_io.finish.finalization) is written once over a RunStore; these tests pin that
the disk (ti_io.finish.disk_store) and the object store (ti_io.finish.object_store) give it the
same answers. The kill and fault matrices of each (tests/test_reliability_finalization.py on
disk, tests/test_io_object_store_writes.py on S3) reach these states by killing real runs.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from _io_helpers import Synth, interrupted_run
from s3_server import S3Store

from ti_io import Consolidated, consolidate
from ti_io.errors import DamagedPartsError, FinalizationError, ShrinkRefusedError
from ti_io.facts import read_run_facts
from ti_io.finish.consolidate import _write_final_files
from ti_io.finish.journal import FinalizationState, Journal
from ti_schema.layout import HISTOGRAM_PARTS, HISTORY_PARTS, JOURNAL_FILE, list_parts, part_name

STORES = ("disk", "s3")


@dataclass
class Placed:
    """A run put in one store: what ``consolidate`` is given, and reads of what it holds."""

    target: str
    local: Path | None
    s3: S3Store | None
    prefix: str

    def _key(self, name: str) -> str:
        assert self.s3 is not None
        return self.s3.key(self.prefix, name)

    def table(self, name: str) -> pa.Table:
        if self.local is not None:
            return pq.read_table(self.local / name)
        assert self.s3 is not None
        return pq.read_table(self._key(name), filesystem=self.s3.filesystem)

    def read(self, name: str) -> bytes | None:
        if self.local is not None:
            path = self.local / name
            return path.read_bytes() if path.is_file() else None
        assert self.s3 is not None
        fs = self.s3.filesystem
        if fs.get_file_info(self._key(name)).type != pafs.FileType.File:
            return None
        with fs.open_input_stream(self._key(name)) as source:
            return bytes(source.read())

    def write(self, name: str, data: bytes) -> None:
        if self.local is not None:
            (self.local / name).write_bytes(data)
            return
        assert self.s3 is not None
        with self.s3.filesystem.open_output_stream(self._key(name)) as out:
            out.write(data)

    def parts(self, parts_dir: str) -> list[str]:
        """The part names left in ``parts_dir``."""
        if self.local is not None:
            return [p.name for p in list_parts(self.local / parts_dir)]
        assert self.s3 is not None
        return sorted(
            k.rsplit("/", 1)[1]
            for k in self.s3.keys(self.prefix, parts_dir)
            if k.endswith(".parquet")
        )

    def journal(self) -> Journal | None:
        text = self.read(JOURNAL_FILE)
        return None if text is None else Journal.from_json(text.decode(), Path(JOURNAL_FILE))


@pytest.fixture(params=STORES)
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[Path], Placed]:
    """Put a run built in a local directory where the test's store keeps it."""

    def put(run: Path) -> Placed:
        if request.param == "disk":
            return Placed(str(run), run, None, "")
        s3: S3Store = request.getfixturevalue("s3")
        prefix = f"runs/{run.name}"
        return Placed(s3.upload(run, prefix), None, s3, prefix)

    return put


def _values(table: pa.Table) -> list[tuple[object, ...]]:
    names = ["sample_id", "layer", "signal", "metric", "value"]
    return sorted(zip(*(table.column(n).to_pylist() for n in names), strict=True), key=repr)


def _same_final_files(placed: Placed, reference: Path) -> None:
    """The finalized run holds the reference's rows, result.json, and nothing of the
    finalization."""
    assert placed.journal() is None
    assert placed.parts(HISTORY_PARTS) == placed.parts(HISTOGRAM_PARTS) == []
    assert _values(placed.table("history.parquet")) == _values(
        pq.read_table(reference / "history.parquet")
    )
    assert placed.table("histograms.parquet").num_rows == (
        pq.read_metadata(reference / "histograms.parquet").num_rows
    )
    assert placed.read("result.json") == (reference / "result.json").read_bytes()
    assert placed.read("index.md") is not None


def _reference(run: Path, where: Path) -> Path:
    shutil.copytree(run, where)
    consolidate(where)
    return where


def _journal(run: Path, state: FinalizationState, rows: tuple[int, int] | None = None) -> None:
    history_rows, histogram_rows = rows if rows is not None else (None, None)
    journal = Journal(state, 12345, "elsewhere", history_rows, histogram_rows)
    (run / JOURNAL_FILE).write_text(journal.to_json())


def test_an_interrupted_run_finalizes_to_the_same_files(
    tmp_path: Path, synth: Callable[..., Synth], place: Callable[[Path], Placed]
) -> None:
    run = interrupted_run(tmp_path / "run", synth())
    reference = _reference(run, tmp_path / "reference")
    placed = place(run)
    done = consolidate(placed.target)
    assert (done.resumed_from, done.already_done, done.skipped) == (None, False, ())
    _same_final_files(placed, reference)
    again = consolidate(placed.target)
    assert again.already_done
    assert (again.history_rows, again.histogram_rows) == (done.history_rows, done.histogram_rows)


@pytest.mark.parametrize("written", [1, 4])
def test_resume_from_writing(
    tmp_path: Path,
    synth: Callable[..., Synth],
    place: Callable[[Path], Placed],
    written: int,
) -> None:
    run = interrupted_run(tmp_path / "run", synth(empty_every=2))
    reference = _reference(run, tmp_path / "reference")
    _journal(run, FinalizationState.WRITING)
    live = {name: (run / name).read_bytes() for name in ("result.json", "index.md")}
    _write_final_files(run, read_run_facts(run))
    if written == 1:  # killed after history.parquet: the rest still the live run's or absent
        (run / "histograms.parquet").unlink()
        for name, content in live.items():
            (run / name).write_bytes(content)
    placed = place(run)
    done = consolidate(placed.target)
    assert done.resumed_from == "writing"
    _same_final_files(placed, reference)


def test_resume_from_written_deletes_what_is_left(
    tmp_path: Path, synth: Callable[..., Synth], place: Callable[[Path], Placed]
) -> None:
    run = interrupted_run(tmp_path / "run", synth())
    reference = _reference(run, tmp_path / "reference")
    rows = _write_final_files(run, read_run_facts(run))
    _journal(run, FinalizationState.WRITTEN, rows)
    for part in list_parts(run / HISTORY_PARTS)[:2]:  # killed while removing the parts
        part.unlink()
    placed = place(run)
    done = consolidate(placed.target)
    assert (done.resumed_from, done.parts) == ("written", 0)
    assert (done.history_rows, done.histogram_rows) == rows
    _same_final_files(placed, reference)


def test_a_final_file_changed_since_it_was_written_stops_the_retirement(
    tmp_path: Path, synth: Callable[..., Synth], place: Callable[[Path], Placed]
) -> None:
    run = interrupted_run(tmp_path / "run", synth())
    rows = _write_final_files(run, read_run_facts(run))
    _journal(run, FinalizationState.WRITTEN, rows)
    pq.write_table(pq.read_table(run / "history.parquet").slice(0, 5), run / "history.parquet")
    parts = sorted(p.name for p in list_parts(run / HISTORY_PARTS))
    placed = place(run)
    with pytest.raises(ShrinkRefusedError, match=f"wrote {rows[0]} rows to history.parquet"):
        consolidate(placed.target)
    assert placed.parts(HISTORY_PARTS) == parts  # every part kept
    journal = placed.journal()
    assert journal is not None
    assert journal.state is FinalizationState.WRITTEN


def test_a_finished_history_is_never_replaced_by_a_smaller_one(
    tmp_path: Path, synth: Callable[..., Synth], place: Callable[[Path], Placed]
) -> None:
    run = interrupted_run(tmp_path / "run", synth())
    consolidate(run)
    rows = pq.read_metadata(run / "history.parquet").num_rows
    (run / HISTORY_PARTS).mkdir()  # parts reappear, holding less than the finished file
    pq.write_table(
        pq.read_table(run / "history.parquet").slice(0, 10), run / HISTORY_PARTS / part_name(0)
    )
    placed = place(run)
    before = placed.read("history.parquet")
    with pytest.raises(ShrinkRefusedError) as refused:
        consolidate(placed.target)
    assert f"history.parquet holds {rows} rows and history.parts/ only 10" in str(refused.value)
    assert placed.read("history.parquet") == before
    assert placed.journal() is None  # refused before anything was changed


def test_a_journal_that_cannot_be_read_is_reported_not_guessed(
    tmp_path: Path, synth: Callable[..., Synth], place: Callable[[Path], Placed]
) -> None:
    run = interrupted_run(tmp_path / "run", synth())
    (run / JOURNAL_FILE).write_text('{"format": "ti.finalization", "version": 1, "state": "?"}')
    placed = place(run)
    with pytest.raises(FinalizationError, match="unknown state '\\?'") as caught:
        consolidate(placed.target)
    assert "delete it and run `ti consolidate` again" in str(caught.value)
    assert placed.parts(HISTORY_PARTS)  # nothing was changed


def test_a_damaged_part_stops_then_is_set_aside(
    tmp_path: Path, synth: Callable[..., Synth], place: Callable[[Path], Placed]
) -> None:
    run = interrupted_run(tmp_path / "run", synth())
    damaged = list_parts(run / HISTORY_PARTS)[1]
    lost = pq.read_metadata(damaged).num_rows
    whole = sum(pq.read_metadata(p).num_rows for p in list_parts(run / HISTORY_PARTS))
    data = damaged.read_bytes()
    damaged.write_bytes(data[: len(data) // 2])  # cut: its footer is gone
    placed = place(run)
    with pytest.raises(DamagedPartsError) as stopped:
        consolidate(placed.target)
    message = str(stopped.value)
    assert f"{placed.target}/{HISTORY_PARTS}/{damaged.name} is damaged" in message
    assert stopped.value.command == f"ti consolidate --skip-damaged {placed.target}"
    assert placed.journal() is None  # left as it was found
    assert damaged.name in placed.parts(HISTORY_PARTS)
    done: Consolidated = consolidate(placed.target, skip_damaged=True)
    assert [s.file for s in done.skipped] == [f"{HISTORY_PARTS}/{damaged.name}"]
    assert done.history_rows == whole - lost
    assert placed.read(f"damaged/{HISTORY_PARTS}/{damaged.name}") == data[: len(data) // 2]
    assert placed.journal() is None
    assert placed.parts(HISTORY_PARTS) == []
    again = consolidate(placed.target)  # finalized: the gap is still reported
    assert again.already_done
    assert again.skipped == done.skipped


def test_a_damaged_final_file_of_a_finalized_run_is_reported_not_rebuilt(
    tmp_path: Path, synth: Callable[..., Synth], place: Callable[[Path], Placed]
) -> None:
    run = interrupted_run(tmp_path / "run", synth())
    consolidate(run)
    placed = place(run)
    data = placed.read("history.parquet")
    assert data is not None
    placed.write("history.parquet", data[: len(data) // 2])
    with pytest.raises(FinalizationError, match=r"is finalized, but .*history\.parquet is damaged"):
        consolidate(placed.target)
    assert placed.read("history.parquet") == data[: len(data) // 2]  # nothing was changed
