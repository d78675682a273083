"""Readers in bounded memory (docs/reading-at-scale.md): the peak RSS of ``ti summary``,
``ti compare``, ``ti validate``, ``ti report`` and ``ti consolidate`` does not grow with the
history.

Each command runs in its own process on a run and on one twice as long (written by the
project's ``DirectorySink``), with partitions of 200,000 rows (``TI_IO_PARTITION_ROWS``) so
that both lengths span several; the process's peak RSS comes from ``os.wait4``. Before the
bounded readers every one of these grew with the history (about 370 bytes a row for
``ti summary``: 1.7x here); a ratio over 1.2 fails. The figures at scale (21.6M and 216M rows,
beside DuckDB) are benchmarks/reading.py's, in benchmarks/README.md.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from ti_io import DirectorySink, HistoryConfig
from ti_io.read.spill import PARTITION_ROWS_VARIABLE
from ti_schema import DEFAULT_METRICS, LayerInfo, RunInfo

pytestmark = pytest.mark.slow

LAYERS = [f"blocks.{i}" for i in range(50)]
ROWS = 1_200_000
BOUND = 1.2


_SPEC = importlib.util.spec_from_file_location(
    "history_finalize", Path(__file__).resolve().parents[1] / "benchmarks" / "history_finalize.py"
)
assert _SPEC is not None
assert _SPEC.loader is not None
history_finalize = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(history_finalize)


def _build(root: Path, rows: int) -> tuple[Path, Path]:
    """A finalized run of ``rows`` rows and a killed copy of it (its parts only)."""
    run, killed = root / "run", root / "killed"
    info = RunInfo(
        run_id="r",
        rank=0,
        world_size=1,
        producer="test",
        started_at=datetime(2026, 1, 1, tzinfo=UTC),
        layers=tuple(LayerInfo(name, "Linear") for name in LAYERS),
        focus_layers=(),
        metrics=DEFAULT_METRICS,
        sampler="AlwaysSampler()",
    )
    sink = DirectorySink(run, history_config=HistoryConfig())
    sink.open(info)
    rng = np.random.default_rng(0)
    per_sample = 2 * len(LAYERS) * len(DEFAULT_METRICS)
    for sample in range(rows // per_sample):
        sink.write_history(history_finalize.sample_batch(sample, LAYERS, rng))
    sink.flush()
    shutil.copytree(run, killed, copy_function=os.link)
    sink.close()
    return run, killed


# Linux keeps a process's peak RSS across exec, so a command forked from this (large) test
# process would report this process's size: a small launcher forks it instead and reports its
# peak from wait4.
LAUNCHER = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(child.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def _peak_mb(*args: str) -> float:
    """The peak RSS (MB) of ``ti ARGS`` run in its own process."""
    environment = {**os.environ, PARTITION_ROWS_VARIABLE: "200000"}
    code = "import sys; from ti_io.cli import main; sys.exit(main())"
    done = subprocess.run(
        [sys.executable, "-c", LAUNCHER, sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=environment,
        check=True,
    )
    status, peak_kb = done.stdout.split()
    assert status == "0", done.stderr
    return int(peak_kb) / 1024


def _commands(root: Path, rows: int) -> dict[str, tuple[str, ...]]:
    """Each reader's arguments on the run of ``rows`` rows under ``root`` (a killed copy is
    consolidated afresh each time)."""
    run, killed, copy = root / "run", root / "killed", root / "copy"
    shutil.rmtree(killed, ignore_errors=True)
    shutil.copytree(root / "parts", killed, copy_function=os.link)
    return {
        "summary": ("summary", str(run), "--csv"),
        "compare": ("compare", str(run), str(copy), "--csv"),
        "validate": ("validate", str(run)),
        "report": ("report", str(run), "-o", str(root / f"{rows}.html"), "--no-progress"),
        "consolidate": ("consolidate", str(killed), "--force", "--no-progress"),
    }


def test_readers_peak_memory_does_not_grow_with_the_history(tmp_path: Path) -> None:
    roots = {}
    for rows in (ROWS, 2 * ROWS):
        root = tmp_path / str(rows)
        run, killed = _build(root, rows)
        killed.rename(root / "parts")
        shutil.copytree(run, root / "copy", copy_function=os.link)
        roots[rows] = root

    def measure(name: str) -> list[float]:
        return [_peak_mb(*_commands(root, rows)[name]) for rows, root in roots.items()]

    peaks = {name: measure(name) for name in _commands(roots[ROWS], ROWS)}
    # A process's peak RSS varies by a few tens of MB from run to run (allocator arenas and
    # the order in which finalization's reader, digester and writer threads finish): a ratio
    # over the bound is measured twice more and each length keeps its lowest peak, so growth
    # with the history fails and a noisy sample does not.
    for name in list(peaks):
        for _ in range(2):
            short, long = peaks[name]
            if long / short <= BOUND:
                break
            peaks[name] = [min(pair) for pair in zip(peaks[name], measure(name), strict=True)]
    grown = {name: long / short for name, (short, long) in peaks.items()}
    assert all(ratio <= BOUND for ratio in grown.values()), (grown, peaks)
