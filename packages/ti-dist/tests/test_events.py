"""Every rank's events of an all-ranks run as one table, and the rank that fired first.

Each rank's run is written by ti-io's real ``DirectorySink`` into ``rank-NNN/`` (events through
its declared ``write_events``), finalized or left live as a killed rank would leave it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from ti_dist import events_across_ranks, first_event
from ti_io import DirectorySink
from ti_schema import LayerInfo, RunInfo, events_schema
from ti_schema.layout import rank_dir_name

START = datetime(2026, 1, 1, tzinfo=UTC)


def _run(rank: int) -> RunInfo:
    return RunInfo(
        run_id=f"run-{rank}",
        rank=rank,
        world_size=3,
        producer="ti-dist tests",
        started_at=START,
        layers=(LayerInfo("fc1", "Linear"), LayerInfo("fc2", "Linear")),
        focus_layers=(),
        metrics=("mean",),
        sampler="EveryNForwardsSampler(n=1)",
        rank_subdir=rank_dir_name(rank),
    )


def _event(
    rank: int,
    event_id: int,
    forward: int,
    seconds: float,
    layer: str,
    replay: str = "reproduced",
) -> pa.RecordBatch:
    row: dict[str, Any] = {
        "run_id": f"run-{rank}",
        "rank": rank,
        "event_id": event_id,
        "kind": "nonfinite",
        "forward_index": forward,
        "timestamp": START + timedelta(seconds=seconds),
        "signal": "output_gradient",
        "layer": layer,
        "module_type": "Linear",
        "tensor_path": "",
        "layers": [layer],
        "tensor_paths": [""],
        "reason": None,
        "value": None,
        "dense_first_forward": forward + 1,
        "dense_forwards": 8,
        "replay": replay,
        "replay_reason": f"{replay}: {layer} on rank {rank}",
    }
    schema = events_schema("ti-dist tests")
    return pa.table({k: [v] for k, v in row.items()}, schema=schema).to_batches()[0]


def _write(root: Path, rank: int, events: list[pa.RecordBatch], *, finalize: bool) -> None:
    sink = DirectorySink(root)
    sink.open(_run(rank))
    write_events = sink.capabilities().write_events
    assert write_events is not None
    for batch in events:
        write_events(batch)
    if finalize:
        sink.close()
    else:  # a killed rank: its event parts are all there is
        sink._closed = True
        assert sink._writer is not None
        sink._writer.stop()


def test_the_rank_that_fired_first_by_forward_then_timestamp(tmp_path: Path) -> None:
    # Rank 2 sees the NaN at forward 7, ranks 0 and 1 at forward 8 (rank 1's clock earlier);
    # rank 1 was killed, its events are parts.
    _write(tmp_path, 0, [_event(0, 0, 8, 5.0, "fc2"), _event(0, 1, 20, 9.0, "fc1")], finalize=True)
    _write(tmp_path, 1, [_event(1, 0, 8, 4.0, "fc1")], finalize=False)
    _write(tmp_path, 2, [_event(2, 0, 7, 6.0, "fc2")], finalize=True)
    frame = events_across_ranks(tmp_path)
    assert frame.select("rank", "forward_index").rows() == [(2, 7), (1, 8), (0, 8), (0, 20)]
    first = first_event(tmp_path)
    assert first is not None
    assert (first["rank"], first["forward_index"], first["layer"]) == (2, 7, "fc2")
    assert first["dense_first_forward"] == 8
    assert first["dense_forwards"] == 8


def test_same_forward_the_earlier_timestamp_wins(tmp_path: Path) -> None:
    _write(tmp_path, 0, [_event(0, 0, 8, 5.0, "fc2")], finalize=True)
    _write(tmp_path, 1, [_event(1, 0, 8, 4.5, "fc1")], finalize=True)
    first = first_event(tmp_path)
    assert first is not None
    assert first["rank"] == 1
    assert first["layer"] == "fc1"


def test_same_forward_a_nan_from_another_rank_comes_after_the_rank_that_made_it(
    tmp_path: Path,
) -> None:
    """Rank 0's clock is earlier, but its replay says the NaN came from another rank: the rank
    whose replay reproduced it is first (clocks of hosts disagree; the verdict does not)."""
    _write(tmp_path, 0, [_event(0, 0, 8, 1.0, "fc1", "from_another_rank")], finalize=True)
    _write(tmp_path, 1, [_event(1, 0, 8, 4.5, "fc2", "reproduced")], finalize=True)
    _write(tmp_path, 2, [_event(2, 0, 9, 0.5, "fc1", "not_reproduced")], finalize=True)
    frame = events_across_ranks(tmp_path)
    assert frame.select("rank", "replay").rows() == [
        (1, "reproduced"),
        (0, "from_another_rank"),
        (2, "not_reproduced"),
    ]
    first = first_event(tmp_path)
    assert first is not None
    assert (first["rank"], first["layer"], first["replay"]) == (1, "fc2", "reproduced")


def test_no_events_anywhere_and_no_run(tmp_path: Path) -> None:
    _write(tmp_path, 0, [], finalize=True)
    _write(tmp_path, 1, [], finalize=False)
    frame = events_across_ranks(tmp_path)
    assert frame.height == 0
    assert "forward_index" in frame.columns
    assert first_event(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="no run found"):
        events_across_ranks(tmp_path / "rank-000" / "tensorboard")
