"""Preemption and exit without ``remove_observer``: every sampled row up to the end survives.

A real training process writes a run with ti-io's ``DirectorySink``, part of its rows published
as parts and the rest still buffered, and is then sent SIGTERM while in its training loop, as a
cluster preempts a job, or simply ends without removing its observer. `ti consolidate` then
finishes the run: every step the process reported as done is in history.parquet with all its
rows (not only the parts published before the signal), the run validates, and the process ended
as the signal (or the user's own handler, which still runs) says. The three children run at
once.
"""

from __future__ import annotations

import contextlib
import io
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from ti_io.cli import main as ti
from ti_schema import DEFAULT_METRICS
from ti_schema.testing import assert_artifact_dir_conforms

LAYERS = 3  # the child's leaf modules
ROWS_PER_STEP = LAYERS * 2 * len(DEFAULT_METRICS)  # outputs and output gradients
PART_STEPS = 3  # a part every three steps (by flush): some published, some buffered

CHILD = textwrap.dedent(
    """
    import signal, sys, time
    import torch
    from torch import nn
    from ti_core import AlwaysSampler, inject_observer
    from ti_io import DirectorySink, HistoryConfig

    out, mode, part_steps, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if mode == "user-handler":  # the program's own handler, installed before the observer
        def on_term(signum, frame):
            with open(f"{out}.handler", "w") as note:
                note.write("ran")
            sys.exit(7)
        signal.signal(signal.SIGTERM, on_term)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    # Parts only when the loop flushes (no clock), so the rows of the last steps stay buffered
    # until the signal.
    sink = DirectorySink(out, history_config=HistoryConfig(flush_seconds=None))
    inject_observer(model, sink=sink, sampler=AlwaysSampler())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    while True:
        if step < steps:
            x = torch.randn(3, 4)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            step += 1
            if step % part_steps == 0:
                sink.flush()
            print(step, flush=True)
        elif mode == "exit":
            break  # no remove_observer: the interpreter exits with the observer attached
        else:
            time.sleep(0.02)  # in its training loop, until preempted
    """
)
STEPS = {"default": 7, "user-handler": 7, "exit": 8}
"""Steps each child trains: 7 and 8 leave one and two steps buffered (a part every three)."""


@dataclass
class Ended:
    """How a child ended, and its run after `ti consolidate` and `ti validate`."""

    out: Path
    code: int
    steps: int
    published_before: int | None
    """History rows in parts when the child had done its steps, before the signal (None for
    the child that exits by itself: it may have ended by then)."""
    consolidate: tuple[int, str, str]
    validate: tuple[int, str, str]


def _ti(*argv: str) -> tuple[int, str, str]:
    """The `ti` command (its entry point, in this process): exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = ti(list(argv))
    return code, out.getvalue(), err.getvalue()


def _published(out: Path) -> int:
    return sum(pq.read_metadata(p).num_rows for p in (out / "history.parts").glob("part-*"))


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ended]:
    """The three children, run at once: each trains its steps; the two preempted ones then
    wait in their training loop for SIGTERM, the third ends by itself."""
    base = tmp_path_factory.mktemp("preempted")
    children = {
        mode: subprocess.Popen(
            [sys.executable, "-c", CHILD, str(base / mode), mode, str(PART_STEPS), str(n)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for mode, n in STEPS.items()
    }
    results = {}
    try:
        for mode, child in children.items():
            assert child.stdout is not None
            lines = []
            while len(lines) < STEPS[mode]:
                line = child.stdout.readline()
                assert line, f"{mode}: the training process ended after {lines}"
                lines.append(int(line))
            published = None
            if mode != "exit":
                published = _published(base / mode)
                child.send_signal(signal.SIGTERM)
            rest, _ = child.communicate(timeout=120)
            assert rest == "", rest
            results[mode] = (child.returncode, lines[-1], published)
    finally:
        for child in children.values():
            child.kill()
            child.wait()
    return {
        mode: Ended(
            base / mode,
            code,
            steps,
            published,
            _ti("consolidate", str(base / mode)),
            _ti("validate", str(base / mode)),
        )
        for mode, (code, steps, published) in results.items()
    }


def _assert_every_step_survives(run: Ended) -> None:
    assert run.consolidate[0] == 0, run.consolidate
    assert run.validate == (0, "ok\n", ""), run.validate
    assert_artifact_dir_conforms(run.out)
    if run.published_before is not None:  # rows of the last step were still buffered
        assert run.published_before < run.steps * ROWS_PER_STEP
    history = pl.read_parquet(run.out / "history.parquet")
    per_step = history.group_by("sample_id").len().sort("sample_id")
    assert per_step.get_column("sample_id").to_list() == list(range(run.steps)), per_step
    assert set(per_step.get_column("len").to_list()) == {ROWS_PER_STEP}, per_step
    histograms = pl.read_parquet(run.out / "histograms.parquet")
    assert sorted(histograms.get_column("sample_id").unique()) == list(range(run.steps))


@pytest.mark.slow
def test_sigterm_publishes_the_buffered_rows_then_ends_the_process_as_sigterm_does(
    ended: dict[str, Ended],
) -> None:
    run = ended["default"]
    assert run.code == -signal.SIGTERM  # the default action, unchanged
    _assert_every_step_survives(run)


@pytest.mark.slow
def test_sigterm_runs_the_users_own_handler_after_publishing(ended: dict[str, Ended]) -> None:
    run = ended["user-handler"]
    assert run.code == 7  # what the user's handler did
    assert Path(f"{run.out}.handler").read_text() == "ran"
    _assert_every_step_survives(run)


@pytest.mark.slow
def test_exit_without_remove_observer_publishes_every_row(ended: dict[str, Ended]) -> None:
    run = ended["exit"]
    assert run.code == 0
    _assert_every_step_survives(run)
