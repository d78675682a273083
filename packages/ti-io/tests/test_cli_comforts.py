"""The ``ti`` command's comforts: ``--version``, exit codes in ``--help``, ``ti summary
--layer`` / ``--csv`` / ``--json``, and progress bars that never reach machine output."""

from __future__ import annotations

import fcntl
import io
import json
import os
import re
import select
import struct
import termios
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from _io_helpers import Synth, make_run

from ti_io import DirectorySink, HistoryConfig, consolidate
from ti_io.cli import PLUGIN_PACKAGES, main, missing_command, plugin_commands
from ti_io.cli.status import EXIT_CODES
from ti_io.cli.version import TI_DISTRIBUTIONS
from ti_io.progress import BAR_DELAY_S, TerminalProgress
from ti_io.read.summary import summary_table
from ti_schema import SCHEMA_VERSION

LAYERS = (("encoder.0", "Linear"), ("encoder.1", "ReLU"), ("decoder.0", "Linear"), ("", "Net"))


def _interrupted(out: Path, s: Synth, samples: int, buffer_rows: int = 40) -> None:
    """A run whose process 'died' after publishing its parts: no close, no finalization."""
    sink = DirectorySink(out, history_config=HistoryConfig(buffer_rows=buffer_rows, window=2))
    sink.open(s.run)
    for i in range(samples):
        sink.write_history(s.history(i))
        sink.write_histograms(s.histograms(i))
    sink._flush_at_exit()


def test_version_names_the_contract_and_every_installed_package(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"data contract {SCHEMA_VERSION}"
    installed = []
    for name in TI_DISTRIBUTIONS:
        try:
            installed.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    assert lines[1:] == installed
    assert f"ti-io {metadata.version('ti-io')}" in lines
    assert f"ti-schema {metadata.version('ti-schema')}" in lines


def test_help_documents_every_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    listed = [int(m) for m in re.findall(r"^  (\d+) ", text.split("exit status:")[1], re.M)]
    assert listed == [code for code, _ in EXIT_CODES] == [0, 1, 2, 141]
    assert main(["summary", "--no-such-option", "x"]) == 2  # argparse's usage error
    assert "unrecognized arguments" in capsys.readouterr().err


def test_exit_codes_follow_the_documented_table(
    tmp_path: Path, synth: Callable[..., Synth], capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    _interrupted(run, synth(make_run(LAYERS)), samples=2)
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["validate", str(run)], 0),
        (["consolidate", str(empty)], 1),  # nothing to consolidate
        (["summary", str(empty)], 1),  # not a run
        (["validate", str(tmp_path / "missing")], 2),
        (["consolidate", str(tmp_path / "missing")], 2),
        (["summary", str(run), "--layer", "nothing*"], 1),
        (["consolidate", str(run), "--window", "0"], 2),
    ]
    for args, code in cases:
        assert main(args) == code, args
        _, err = capsys.readouterr()
        assert ("Traceback" in err) is False
        assert (err != "") == (code != 0), (args, err)


def test_summary_layer_globs_select_layers(
    tmp_path: Path, synth: Callable[..., Synth], capsys: pytest.CaptureFixture[str]
) -> None:
    _interrupted(tmp_path, synth(make_run(LAYERS)), samples=3)
    everything = summary_table(tmp_path)
    encoder = summary_table(tmp_path, layers=["encoder.*"])
    assert set(encoder.get_column("layer")) == {"encoder.0", "encoder.1"}
    assert encoder.equals(everything.filter(pl.col("layer").str.starts_with("encoder.")))
    picked = summary_table(tmp_path, layers=["*.0", "decoder.?"])
    assert set(picked.get_column("layer")) == {"encoder.0", "decoder.0"}
    assert set(summary_table(tmp_path, layers=[""]).get_column("layer")) == {""}  # the root
    assert main(["summary", str(tmp_path), "--layer", "decoder.*"]) == 0
    out = capsys.readouterr().out
    body = out.split("╞", 1)[1]
    assert "decoder.0" in body
    assert "encoder" not in body
    assert "(root)" not in body


def test_summary_csv_and_json_are_the_table_alone(
    tmp_path: Path, synth: Callable[..., Synth], capsys: pytest.CaptureFixture[str]
) -> None:
    """Machine output: every column, names unescaped, catalog layers that never ran as rows
    with ``executed`` false, nothing else on stdout; every statistic from the rows."""
    s = synth(make_run(LAYERS))  # rows for these layers only
    run = make_run((*LAYERS, ("never.ran", "Linear")))  # the catalog lists one more
    sink = DirectorySink(tmp_path, history_config=HistoryConfig(buffer_rows=40, window=2))
    sink.open(run)
    rows = [s.history(i) for i in range(4)]
    for batch in rows:
        sink.write_history(batch)
    sink.close()

    assert main(["summary", str(tmp_path), "--csv"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    frame = pl.read_csv(out.encode(), schema=summary_table(tmp_path).schema)
    assert frame.height == summary_table(tmp_path).height
    never = frame.filter(~pl.col("executed"))
    assert never.get_column("layer").to_list() == ["never.ran"]
    assert never.drop("layer", "executed").null_count().row(0) == ((1,) * (len(frame.columns) - 2))

    assert main(["summary", str(tmp_path), "--json", "--metric", "max"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    table = json.loads(out, parse_constant=lambda token: pytest.fail(token))
    measured = [r for r in table if r["executed"]]
    assert {r["metric"] for r in measured} == {"max"}
    assert any(r["layer"] == "" for r in measured)  # the root, not "(root)"
    history = pl.concat([pl.DataFrame(pl.from_arrow(batch)) for batch in rows])
    for record in measured:
        values = (
            history.filter(
                (pl.col("layer") == record["layer"])
                & (pl.col("signal") == record["signal"])
                & (pl.col("metric") == "max")
            )
            .sort("sample_id")
            .get_column("value")
            .to_numpy()
            .astype(np.float64)
        )
        assert record["latest"] == values[-1]
        assert record["mean"] == pytest.approx(values.mean(), rel=1e-12)
        assert record["p50"] == pytest.approx(np.percentile(values, 50), rel=1e-12)
        assert record["recent_window_mean"] == pytest.approx(values[-2:].mean(), rel=1e-12)
        assert record["previous_window_mean"] == pytest.approx(values[-4:-2].mean(), rel=1e-12)
        assert record["observations"] == 4


def test_consolidate_reports_progress_per_part(tmp_path: Path, synth: Callable[..., Synth]) -> None:
    _interrupted(tmp_path, synth(make_run(LAYERS)), samples=6, buffer_rows=20)
    parts = len(list((tmp_path / "history.parts").glob("part-*.parquet"))) + len(
        list((tmp_path / "histograms.parts").glob("part-*.parquet"))
    )
    assert parts > 4
    seen: list[tuple[int, int]] = []
    done = consolidate(tmp_path, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(i, parts) for i in range(1, parts + 1)]
    assert done.parts == parts


def test_progress_goes_to_stderr_only_when_asked_or_on_a_terminal(
    tmp_path: Path, synth: Callable[..., Synth], capsys: pytest.CaptureFixture[str]
) -> None:
    s = synth(make_run(LAYERS))
    for name, flag in (("quiet", []), ("asked", ["--progress"]), ("off", ["--no-progress"])):
        _interrupted(tmp_path / name, s, samples=4, buffer_rows=20)
        assert main(["consolidate", str(tmp_path / name), *flag]) == 0
        out, err = capsys.readouterr()
        assert out.startswith(f"{tmp_path / name}: consolidated ")  # stdout: the result only
        assert ("consolidating" in err) == (name == "asked"), (name, err)  # stderr is no TTY

    # On a terminal (a real pseudo-terminal, 100 columns) the bar shows by itself, once an
    # operation outlasts BAR_DELAY_S.
    leader, follower = os.openpty()
    try:
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        with open(follower, "w", encoding="utf-8", closefd=False) as tty:
            with TerminalProgress("consolidating", "parts", enabled=None, stream=tty) as bar:
                bar(1, 3)
                time.sleep(BAR_DELAY_S + 0.2)  # a long operation
                bar(2, 3)
            tty.flush()
        ready, _, _ = select.select([leader], [], [], 10)
        written = os.read(leader, 65536).decode() if ready else ""
    finally:
        os.close(leader)
        os.close(follower)
    assert "consolidating" in written
    assert "2/3" in written

    silent = io.StringIO()  # not a terminal, not asked: nothing at all
    with TerminalProgress("consolidating", "parts", enabled=None, stream=silent) as bar:
        bar(1, 3)
        bar(3, 3)
    assert silent.getvalue() == ""


def test_a_command_of_another_package_names_the_package_to_install(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``ti drift`` comes with ti-dist (the ``ti.commands`` entry points); without it, or when it
    fails to load, ``ti drift`` says which package to install instead of "invalid choice"."""
    assert PLUGIN_PACKAGES["drift"] == "ti-dist"
    missing = missing_command(["drift", "RUN"], [], {})
    assert missing == "ti drift: this command comes with ti-dist; install it: pip install ti-dist"
    broken = missing_command(["drift", "RUN"], [], {"drift": "ImportError: boom"})
    assert broken == (
        "ti drift: ti-dist is installed but its command failed to load: ImportError: boom"
    )
    assert missing_command(["drift", "RUN"], ["drift"], {}) is None
    assert missing_command(["summary", "RUN"], [], {}) is None
    # As installed here: the command runs when ti-dist is, and is named when it is not.
    installed = "drift" in plugin_commands()[0]
    assert main(["drift", "--help"]) == (0 if installed else 2)
    captured = capsys.readouterr()
    assert ("RUN_DIR" in captured.out) if installed else ("pip install ti-dist" in captured.err)
