"""Finalization can be killed at any file operation, or have any one fail, and lose nothing.

``finalization_faults.py`` (beside this file) runs ``remove_observer`` on a live run, and `ti
consolidate` on a run whose process was killed, under a fault injector built on Python's audit
hooks: once to record every file operation (the trace), then once per operation N with a real
SIGKILL just before it, and once per operation with it failing (EIO, ENOSPC, EACCES). After
each, `ti consolidate` (after a failure: the command the message named, run while the failed
program still lives) and `ti validate` must succeed, and the run must hold exactly the rows of
the uninterrupted run: after a kill during ``remove_observer`` minus only the rows that were
still in memory (the parts its drain had not published yet), and otherwise everything, with the
same result.json and index.md. The driver's docstring says what counts as an operation.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ti_schema.artifacts import artifact_dir_problems

DRIVER = Path(__file__).with_name("finalization_faults.py")
SCENARIOS = ("remove_observer", "consolidate")
STRERROR = {"EIO": os.strerror(5), "ENOSPC": os.strerror(28), "EACCES": os.strerror(13)}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("faults")
    jobs = min(4, 2 * (os.cpu_count() or 1))  # cases wait on fsync as much as they compute
    done = subprocess.run(
        [sys.executable, str(DRIVER), str(base), str(jobs)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report: dict[str, Any] = json.loads((base / "results.json").read_text())
    return report


RUN_FACTS = re.compile(r"^(run_id|started_at|time span|Telemetry cost): .*$", re.MULTILINE)
"""Facts of the run's own: its id, its times and its measured telemetry cost (a killed run's
cost is what its observer last reported, or unknown)."""


@cache
def _tables(run: str) -> dict[str, Any]:
    """A finalized run's content. Every remove_observer case trains a run of its own, with
    the same values but its own run id and times: those are left out."""
    directory = Path(run)
    own = ["run_id", "timestamp"]
    return {
        "history": pq.read_table(directory / "history.parquet").drop_columns(own),
        "histograms": pq.read_table(directory / "histograms.parquet").drop_columns(own),
        "result.json": (directory / "result.json").read_bytes(),
        # index.md names its own directory (its queries run as they are) and the run's facts
        "index.md": RUN_FACTS.sub(r"\1: -", (directory / "index.md").read_text()).replace(
            run, "RUN"
        ),
    }


def _reference(faults: dict[str, Any], scenario: str) -> tuple[str, dict[str, Any]]:
    reference = faults[scenario]["reference"]
    assert reference["status"] == 0, reference
    assert "exception" not in reference, reference["exception"]
    run = str(Path(faults[scenario]["cases"][0]["dir"]).with_name("reference"))
    return run, reference


def _assert_finalized(run: Path) -> None:
    """Finished: no journal, no parts, no temporary anywhere, every file conforms."""
    left = sorted(
        str(p.relative_to(run))
        for p in run.rglob("*")
        if p.name in ("finalization.json", "history.parts", "histograms.parts")
        or p.name.endswith(".ti-tmp")
    )
    assert left == []
    assert artifact_dir_problems(run) == []


def _assert_recovered(case: dict[str, Any]) -> None:
    recovery = case["recovery"]
    assert "exception" not in case, case["exception"]
    assert recovery["consolidate"]["code"] == 0, recovery
    assert (recovery["validate"]["code"], recovery["validate"]["out"]) == (0, "ok\n"), recovery
    _assert_finalized(Path(case["dir"]))


def _label(case: dict[str, Any]) -> str:
    return f"{case['mode']} at operation {case['at']} {case.get('errno', '')}".strip()


def test_the_trace_covers_every_step_of_finalization(faults: dict[str, Any]) -> None:
    """The injector sees what finalization does (else the other tests would prove nothing)."""
    for scenario in SCENARIOS:
        _, reference = _reference(faults, scenario)
        trace = [tuple(op) for op in reference["trace"]]
        renamed = [path for event, path in trace if event == "os.rename"]
        for published in (
            ".finalization.json.TMP.ti-tmp",  # writing, then written
            ".history.parquet.TMP.ti-tmp",
            ".histograms.parquet.TMP.ti-tmp",
            ".result.json.TMP.ti-tmp",
            ".index.md.TMP.ti-tmp",
            "history.parts",  # retired
            "histograms.parts",
        ):
            assert published in renamed, (scenario, published)
        assert renamed.count(".finalization.json.TMP.ti-tmp") == 2
        assert ("os.remove", "finalization.json") in trace
        assert ("fcntl.flock", ".") in trace
        assert sum(event == "os.fsync" for event, _ in trace) >= 12
        cases = faults[scenario]["cases"]
        assert [c["at"] for c in cases if c["mode"] == "kill"] == list(range(1, len(trace) + 1))
        failed = {c["at"] for c in cases if c["mode"] == "fail"}
        assert failed == set(range(1, len(trace) + 1))
        met = {(trace[c["at"] - 1][0], c["errno"]) for c in cases if c["mode"] == "fail"}
        assert met == {(event, e) for event, _ in trace for e in STRERROR}
    # remove_observer first publishes what the sink still buffered: one history part and
    # one histogram part, then finalizes
    _, reference = _reference(faults, "remove_observer")
    assert [p["kind"] for p in reference["renamed_parts"]] == ["history", "histograms"]
    assert reference["said"] == []  # no warning in the uninterrupted run


def test_a_kill_at_any_operation_of_remove_observer_loses_only_rows_still_in_memory(
    faults: dict[str, Any],
) -> None:
    run, reference = _reference(faults, "remove_observer")
    want = _tables(run)
    parts = reference["renamed_parts"]
    for case in (c for c in faults["remove_observer"]["cases"] if c["mode"] == "kill"):
        assert case["status"] == -9, (_label(case), case)  # really killed, at that operation
        _assert_recovered(case)
        # a part is published once its rename ran; the kill came just before operation `at`
        held = {
            kind: reference["base"][kind]
            + sum(p["rows"] for p in parts if p["kind"] == kind and p["op"] < case["at"])
            for kind in ("history", "histograms")
        }
        got = _tables(case["dir"])
        for kind in ("history", "histograms"):
            expected: pa.Table = want[kind].slice(0, held[kind])
            assert got[kind].equals(expected), (_label(case), kind, got[kind].num_rows, held)
        if held == {k: want[k].num_rows for k in held}:  # everything was published
            assert got["result.json"] == want["result.json"], _label(case)
            assert got["index.md"] == want["index.md"], _label(case)
    last_part = max(p["op"] for p in parts)
    # from the publication of the last buffered part on, a kill loses nothing at all
    assert len(reference["trace"]) - last_part > 50


def test_a_kill_at_any_operation_of_consolidate_loses_nothing(faults: dict[str, Any]) -> None:
    run, _ = _reference(faults, "consolidate")
    want = _tables(run)
    for case in (c for c in faults["consolidate"]["cases"] if c["mode"] == "kill"):
        assert case["status"] == -9, (_label(case), case)
        _assert_recovered(case)
        assert _tables(case["dir"]) == want, _label(case)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_any_operation_failing_once_loses_nothing_and_the_named_command_finishes(
    faults: dict[str, Any], scenario: str
) -> None:
    run, _ = _reference(faults, scenario)
    want = _tables(run)
    stopped = 0
    for case in (c for c in faults[scenario]["cases"] if c["mode"] == "fail"):
        label = _label(case)
        assert case["status"] == 0, (label, case)  # the program went on
        assert case["failed"] is not None, label  # the operation did fail
        said = [text for text in case["said"] if text.strip()]
        if scenario == "remove_observer":
            assert len(said) <= 1, (label, said)  # at most one warning
        else:
            assert case["code"] == (1 if case["command"] else 0), (label, said)
        if case["command"] is not None:  # finalization stopped: the message says how to go on
            stopped += 1
            message = said[-1]
            assert STRERROR[case["errno"]] in message, (label, message)
            assert "Nothing is lost" in message, (label, message)
            assert case["dir"] in message, (label, message)
            assert case["recovery"]["command"] == case["command"], label
        else:  # the failure was absorbed (a part written again, a directory sync skipped)
            assert "already consolidated" in case["recovery"]["consolidate"]["out"], label
        _assert_recovered(case)
        assert _tables(case["dir"]) == want, label
    assert stopped > 40  # most failures do stop finalization: the messages were checked
