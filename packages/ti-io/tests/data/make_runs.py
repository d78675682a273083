"""Regenerate the run directories that ti-io's tests read without torch.

Needs torch, ti-core and ti-io (any development venv of the monorepo)::

    python packages/ti-io/tests/data/make_runs.py

writes ``core-runs/`` next to this file (replacing it): real runs observed by ti-core and
written by ti-io's DirectorySink.

- ``finalized/``: a tiny model trained for a few steps, observer removed (finalized run), with
  every signal of the contract (outputs, their gradients, the parameters, their gradients and
  their updates), the flight recorder's sentinel on and one manual event (``trigger_capture``
  after the second step), so ``events.parquet`` and its parts hold a row.
- ``live/``: the same run copied while it was live, after ``DirectorySink.flush()``: parts,
  ``run.json``, the catalog result.json, the live index.md and TensorBoard events; what a
  ``kill -9`` at that moment leaves. Consolidating it must give the finalized run.
- ``ranks/rank-000/`` (finalized) and ``ranks/rank-001/`` (live): two rank-private runs, rank
  and directory chosen by a rank policy object (no process group needed).

The writer's host in ``run.json`` is replaced by a name no machine has, so ``ti consolidate``
never mistakes a process of the machine running the tests for the writer (the only change made
to what was written). tests/test_io_core_written_data.py fails when the current writer would
produce differently shaped data (files, schemas, footers, JSON keys): then run this script.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Final

import torch
from torch import nn

from ti_core import (
    AlwaysSampler,
    RankSelection,
    inject_observer,
    remove_observer,
    trigger_capture,
)
from ti_io import DirectorySink, HistoryConfig
from ti_schema import DEFAULT_SIGNALS, SIGNALS
from ti_schema.layout import HISTORY_PARTS, RUN_FILE, rank_dir_name

DATA: Final[Path] = Path(__file__).resolve().parent / "core-runs"
STEPS: Final[int] = 4
WINDOW: Final[int] = 2
HOST: Final[str] = "ti-io-test-data"


class FixedRank:
    """A rank policy that observes as ``rank`` of ``world_size`` into its rank directory."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def select(self) -> RankSelection:
        return RankSelection(self.rank, self.world_size, True, rank_dir_name(self.rank))

    def __repr__(self) -> str:
        return f"FixedRank({self.rank}, {self.world_size})"


def _model() -> nn.Sequential:
    torch.manual_seed(20260101)
    return nn.Sequential(OrderedDict(encoder=nn.Linear(5, 8), act=nn.ReLU(), head=nn.Linear(8, 3)))


def _train(
    model: nn.Module, seed: int, after_step: Callable[[], None], *, event: bool = False
) -> None:
    # Adam: the optimizer_state signal (contract 1.5) has moments to read
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(seed)
    for step in range(STEPS):
        optimizer.zero_grad()
        x = torch.randn(6, 5, generator=g)
        loss = (model(x) - x[:, :3]).pow(2).mean()
        loss.backward()
        optimizer.step()
        if event and step == 1:
            trigger_capture(model, forwards=2, reason="committed test data")
        after_step()


def _observed_run(
    output_dir: Path,
    live_copy: Path | None,
    *,
    seed: int,
    rank_policy: object = "rank0",
    signals: tuple[str, ...] = DEFAULT_SIGNALS,
    sentinel: bool = False,
) -> None:
    """Train one observed run in ``output_dir``; copy it to ``live_copy`` before removal."""
    model = _model()
    # One part per step, whatever the machine's speed: published by flush, not by the clock
    # (the file list is compared with a fresh run's by tests/test_io_core_written_data.py).
    sink = DirectorySink(
        output_dir, history_config=HistoryConfig(window=WINDOW, flush_seconds=None)
    )
    inject_observer(
        model,
        sink=sink,
        sampler=AlwaysSampler(),
        rank_policy=rank_policy,
        signals=signals,
        sentinel=sentinel,
    )
    try:
        _train(model, seed, sink.flush, event=sentinel)
        if live_copy is not None:
            sink.flush()  # every row published: the state a kill -9 now would leave
            shutil.copytree(sink.directory, live_copy)
            _anonymize_host(live_copy)
    finally:
        remove_observer(model)


def _anonymize_host(run: Path) -> None:
    path = run / HISTORY_PARTS / RUN_FILE
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc["host"] = HOST
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_runs(destination: Path) -> None:
    """Write ``finalized/``, ``live/`` and ``ranks/`` into ``destination`` (must not exist)."""
    destination.mkdir(parents=True)
    _observed_run(
        destination / "finalized", destination / "live", seed=1, signals=SIGNALS, sentinel=True
    )
    ranks = destination / "ranks"
    _observed_run(ranks, None, seed=2, rank_policy=FixedRank(0, 2))
    with tempfile.TemporaryDirectory() as scratch:
        _observed_run(
            Path(scratch),
            ranks / rank_dir_name(1),
            seed=3,
            rank_policy=FixedRank(1, 2),
        )


def main() -> int:
    staging = DATA.with_name(DATA.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    write_runs(staging)
    shutil.rmtree(DATA, ignore_errors=True)
    staging.rename(DATA)
    print(f"wrote {DATA}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
