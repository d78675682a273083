"""A damaged file is detected, never read as numbers, and never costs the rest of the run.

Runs written by ti-core on a small real model (a crash leaves its parts; a removal finalizes it)
are damaged as a disk or a copy would (tests/run_damage.py): one bit flipped in a data page of
the ``value`` column, a part cut short at several offsets, its footer removed or garbled, a
file replaced by zeros. Then ``ti validate`` names each damaged file and what is wrong with it,
no reader of ti (``scan_history``, ``ti summary``, ``ti compare``, ti-dist, ``consolidate``)
reads a flipped value as data, ``ti consolidate`` refuses naming ``--skip-damaged``, and with it
finishes with every intact row (compared value for value with the intact parts), the damaged
part kept byte for byte under ``damaged/`` and the gap stated in index.md, result facts and
``ti summary``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from ti_core import AlwaysSampler, inject_observer, observer_of, remove_observer
from ti_dist import scan_ranks
from ti_io import (
    DamagedFileError,
    DamagedPartsError,
    DirectorySink,
    FinalizationError,
    HistoryConfig,
    consolidate,
    scan_history,
    validate_run,
)
from ti_io.cli import main as ti
from ti_io.integrity import verify_parquet
from ti_io.write.directory_sink import _flush_live_sinks
from ti_schema.layout import HISTORY_PARTS, list_parts

ROWS_PER_PART = 120
DRIVER = Path(__file__).with_name("finalization_faults.py")
_SPEC = importlib.util.spec_from_file_location(
    "run_damage", Path(__file__).with_name("run_damage.py")
)
assert _SPEC is not None
assert _SPEC.loader is not None
run_damage = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(run_damage)


def _train(model: nn.Module, steps: int, after_step: Callable[[int], None]) -> None:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x = torch.randn(8, 6)
        loss = (model(x) - x[:, :2]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        after_step(step)


def _write_run(directory: Path, *, finalize: bool) -> None:
    """A real run of ti-core: parts left as a crash leaves them, or finalized by removal."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    sink = DirectorySink(
        directory, history_config=HistoryConfig(buffer_rows=ROWS_PER_PART, flush_seconds=None)
    )
    inject_observer(model, sink=sink, sampler=AlwaysSampler(), max_histogram_modules=1)
    observer = observer_of(model)
    assert observer is not None

    def publish_every_third_step(step: int) -> None:
        # Part boundaries fixed by the test, not by how fast the writer thread keeps up (a
        # slow machine merges what gathers while it writes into fewer, larger parts).
        if step % 3 == 2:
            observer.drain()
            sink.flush()

    try:
        _train(model, steps=12, after_step=publish_every_third_step)
        if not finalize:
            _flush_live_sinks()  # what a crash leaves: every row published as parts, no more
    finally:
        remove_observer(model)  # after the flush the sink is closed: only the hooks go


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("crashed") / "run"
    _write_run(run, finalize=False)
    assert not (run / "history.parquet").exists()
    assert len(list_parts(run / HISTORY_PARTS)) >= 4
    return run


@pytest.fixture(scope="module")
def finalized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("finalized") / "run"
    _write_run(run, finalize=True)
    assert (run / "history.parquet").is_file()
    assert not (run / HISTORY_PARTS).exists()
    return run


@pytest.fixture
def run(crashed: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(crashed, copy)
    return copy


def _ti(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = ti(list(argv))
    return code, out.getvalue(), err.getvalue()


def _sorted(table: pa.Table) -> pa.Table:
    keys = ["sample_id", "layer", "call_index", "signal", "tensor_path", "metric"]
    return table.select(sorted(table.column_names)).sort_by([(k, "ascending") for k in keys])


def _parts_table(parts: list[Path]) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in parts)


def _damaged_part(run: Path) -> Path:
    return list_parts(run / HISTORY_PARTS)[2]


DAMAGE: dict[str, tuple[Callable[[Path], object], str]] = {
    "bit flipped in a value page": (run_damage.flip_value_bit, "a page fails its checksum"),
    "cut to 10 bytes": (lambda p: run_damage.truncate(p, 10), "is truncated or lost its footer"),
    "cut in half": (
        lambda p: run_damage.truncate(p, p.stat().st_size // 2),
        "is truncated or lost its footer",
    ),
    "cut 3 bytes short": (
        lambda p: run_damage.truncate(p, p.stat().st_size - 3),
        "is truncated or lost its footer",
    ),
    "footer removed": (run_damage.remove_footer, "is truncated or lost its footer"),
    "footer garbled": (run_damage.garble_footer, "its footer does not parse"),
    "replaced by zeros": (run_damage.zero, "holds only zero bytes"),
    "emptied": (lambda p: run_damage.truncate(p, 0), "is empty"),
}


def test_a_flipped_bit_reads_as_other_numbers_without_checksums(run: Path) -> None:
    """The control: the flip does change numbers when nothing verifies the page."""
    part = _damaged_part(run)
    before = pq.read_table(part).column("value").to_numpy(zero_copy_only=False)
    run_damage.flip_value_bit(part)
    unverified = pq.ParquetFile(part, page_checksum_verification=False).read()
    after = unverified.column("value").to_numpy(zero_copy_only=False)
    changed = ~((before == after) | (np.isnan(before) & np.isnan(after)))
    assert changed.sum() >= 1
    with pytest.raises(OSError, match="CRC checksum verification failed"):
        pq.ParquetFile(part, page_checksum_verification=True).read()


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_part_is_named_refused_then_skipped_with_the_gap_stated(
    run: Path, damage: str
) -> None:
    do, what = DAMAGE[damage]
    parts = list_parts(run / HISTORY_PARTS)
    part = _damaged_part(run)
    intact = [p for p in parts if p != part]
    want = _sorted(_parts_table(intact))
    rows_held = pq.read_metadata(part).num_rows
    do(part)
    damaged_bytes = part.read_bytes()
    name = f"{HISTORY_PARTS}/{part.name}"

    # ti validate names the file and what is wrong; exit 1
    found = validate_run(run)
    assert not found.ok
    [problem] = found.problems  # one line for the file, no contract noise about it
    assert problem.startswith(f"{part}: damaged: ")
    assert what in problem
    code, out, _ = _ti("validate", str(run))
    assert code == 1, out
    assert str(part) in out, out
    assert what in out, out

    # no reader reads it as data
    with pytest.raises(DamagedFileError, match=part.name):
        scan_history(run)
    with pytest.raises(DamagedFileError, match=part.name):
        scan_ranks(run)
    code, _, err = _ti("summary", str(run))
    assert code == 1, err
    assert part.name in err, err

    # consolidate refuses, changes nothing, names the option
    with pytest.raises(DamagedPartsError, match="--skip-damaged") as refused:
        consolidate(run)
    assert refused.value.command == f"ti consolidate --skip-damaged {run}"
    code, _, err = _ti("consolidate", str(run))
    assert code == 1, err
    assert "--skip-damaged" in err, err
    assert part.name in err, err
    assert not (run / "history.parquet").exists()
    assert not (run / "finalization.json").exists()  # the run is left as it was found
    assert list_parts(run / HISTORY_PARTS) == parts
    assert part.read_bytes() == damaged_bytes

    # with the option: every intact row, the damaged part kept, the gap stated
    code, out, err = _ti("consolidate", "--skip-damaged", str(run))
    assert code == 0, err
    assert name in err, err
    assert "damaged/" in err, err
    history = pq.read_table(run / "history.parquet")
    assert _sorted(history).equals(want)  # values included
    kept = run / "damaged" / HISTORY_PARTS / part.name
    assert kept.read_bytes() == damaged_bytes
    record = json.loads((run / "damaged" / "skipped.json").read_text())
    [skipped] = record["skipped"]
    assert skipped["file"] == name
    assert skipped["bytes"] == len(damaged_bytes)
    assert skipped["rows"] == (rows_held if damage == "bit flipped in a value page" else None)
    assert what in skipped["problem"]
    index = (run / "index.md").read_text()
    assert "**Gap: 1 damaged part(s) were skipped" in index
    assert name in index
    code, out, _ = _ti("summary", str(run))
    assert code == 0, out
    lines = out.splitlines()
    [gap] = [n for n, line in enumerate(lines[:6]) if line.startswith("GAP: 1 damaged part(s)")]
    assert name in lines[gap + 1], out
    found = validate_run(run)
    assert found.ok, found.problems
    assert any("damaged part(s) were skipped" in n for n in found.notes)

    # a second run is a no-op
    again = consolidate(run, skip_damaged=True)
    assert again.already_done
    assert [s.file for s in again.skipped] == [name]
    assert pq.read_table(run / "history.parquet").equals(history)


def test_several_damaged_parts_are_all_named_and_all_skipped(run: Path) -> None:
    parts = list_parts(run / HISTORY_PARTS)
    histogram_part = list_parts(run / "histograms.parts")[0]
    want = _sorted(_parts_table(parts[1:-1]))
    run_damage.flip_value_bit(parts[0])
    run_damage.truncate(parts[-1], 100)
    run_damage.zero(histogram_part)
    found = validate_run(run)
    named = sorted(p.split(":")[0] for p in found.problems)
    assert named == sorted(map(str, [parts[0], parts[-1], histogram_part]))
    done = consolidate(run, skip_damaged=True)
    assert sorted(s.file for s in done.skipped) == sorted(
        [
            f"history.parts/{parts[0].name}",
            f"history.parts/{parts[-1].name}",
            f"histograms.parts/{histogram_part.name}",
        ]
    )
    assert _sorted(pq.read_table(run / "history.parquet")).equals(want)
    assert validate_run(run).ok


def _copy(source: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "final"
    shutil.copytree(source, copy)
    return copy


@pytest.mark.parametrize(
    ("damage", "what"),
    [
        (run_damage.flip_value_bit, "a page fails its checksum"),
        (lambda p: run_damage.truncate(p, p.stat().st_size // 3), "truncated"),
        (run_damage.zero, "holds only zero bytes"),
    ],
)
def test_a_damaged_final_file_with_the_parts_retired_is_named_and_never_read(
    finalized: Path, tmp_path: Path, damage: Callable[[Path], object], what: str
) -> None:
    run = _copy(finalized, tmp_path)
    final = run / "history.parquet"
    damage(final)
    found = validate_run(run)
    assert [p for p in found.problems if p.startswith(f"{final}: damaged: ")], found.problems
    assert what in found.problems[0]
    assert _ti("validate", str(run))[0] == 1
    with pytest.raises(DamagedFileError, match=r"history\.parquet"):
        scan_history(run)
    code, _, err = _ti("summary", str(run))
    assert code == 1
    assert "history.parquet" in err
    code, _, err = _ti("compare", str(run), str(finalized))
    assert code == 1, err
    assert "history.parquet" in err, err
    with pytest.raises(FinalizationError, match="parts were retired") as stopped:
        consolidate(run, skip_damaged=True)
    assert "nothing was changed" in str(stopped.value)
    assert not (run / "damaged").exists()


def test_files_without_checksums_are_read_and_said_to_be_unverifiable(run: Path) -> None:
    """A run written before page checksums: read as before; ``ti validate`` says so, once."""
    parts = list_parts(run / HISTORY_PARTS)
    for part in parts:
        table = pq.read_table(part)
        pq.write_table(table, part, compression="lz4", write_page_checksum=False)
    want = _sorted(_parts_table(parts))
    found = validate_run(run)
    assert found.ok, found.problems
    assert sorted(found.unverified) == sorted(parts)
    [note] = [n for n in found.notes if "cannot be verified" in n]
    assert note.startswith(f"{len(parts)} Parquet file(s) have no page checksums")
    code, out, err = _ti("validate", str(run))
    assert (code, out) == (0, "ok\n")
    assert len([line for line in err.splitlines() if "cannot be verified" in line]) == 1
    assert _sorted(scan_history(run).collect().to_arrow()).cast(want.schema).equals(want)


def test_every_file_ti_writes_carries_page_checksums(finalized: Path, crashed: Path) -> None:
    files = [finalized / "history.parquet", finalized / "histograms.parquet"]
    files += list_parts(crashed / HISTORY_PARTS) + list_parts(crashed / "histograms.parts")
    assert all(verify_parquet(file).checksummed for file in files)
    assert validate_run(finalized).unverified == ()
    assert validate_run(crashed).unverified == ()


@pytest.mark.slow
def test_a_kill_at_any_operation_of_skip_damaged_is_survived(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`ti consolidate --skip-damaged` killed (SIGKILL) just before each of its file
    operations in turn, then run again: always the uninterrupted result (the same tables,
    the damaged part kept byte for byte, recorded once), never a lost row or part."""
    base = tmp_path_factory.mktemp("skip-faults")
    done = subprocess.run(
        [sys.executable, str(DRIVER), str(base), "2", "skip_damaged"],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((base / "results.json").read_text())["skip_damaged"]
    assert report["reference"]["status"] == 0, report["reference"]
    trace = report["reference"]["trace"]
    renamed = [path for event, path in trace if event == "os.rename"]
    assert "damaged/.skipped.json.TMP.ti-tmp" in renamed  # the record, published
    assert any(path.startswith("history.parts/part-") for path in renamed)  # the move
    reference = base / "skip_damaged" / "reference"
    kept = sorted(p.relative_to(reference) for p in (reference / "damaged").rglob("*.parquet"))
    assert len(kept) == 1
    want = _final_content(reference)
    cases = report["cases"]
    assert [c["at"] for c in cases] == list(range(1, len(trace) + 1))
    for case in cases:
        label = f"kill at operation {case['at']}"
        assert "exception" not in case, case["exception"]
        assert case["status"] == -9, (label, case)
        recovery = case["recovery"]
        assert recovery["consolidate"]["code"] == 0, (label, recovery)
        assert recovery["validate"]["code"] == 0, (label, recovery)
        run = Path(case["dir"])
        assert not (run / HISTORY_PARTS).exists(), label
        assert not list(run.glob("**/*.ti-tmp")), label
        assert not (run / "finalization.json").exists(), label
        assert _final_content(run) == want, label
        left = sorted(p.relative_to(run) for p in (run / "damaged").rglob("*.parquet"))
        assert left == kept, label
        assert (run / kept[0]).read_bytes() == (reference / kept[0]).read_bytes(), label


def _final_content(run: Path) -> tuple[pa.Table, pa.Table, list[dict[str, object]], str]:
    history = pq.read_table(run / "history.parquet").drop_columns(["run_id", "timestamp"])
    histograms = pq.read_table(run / "histograms.parquet").drop_columns(["run_id", "timestamp"])
    skipped = json.loads((run / "damaged" / "skipped.json").read_text())["skipped"]
    gap = [line for line in (run / "index.md").read_text().splitlines() if "Gap" in line]
    return history, histograms, skipped, "\n".join(gap)
