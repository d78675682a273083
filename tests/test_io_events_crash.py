"""An event survives ``kill -9`` right after it was handed to the sink: a real training process
(ti-core's observer, ti-io's DirectorySink) writes an event through the sink's declared
``write_events`` and is killed before any finalization; ``ti consolidate`` recovers it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq

from ti_io import read_events, scan_history
from ti_io.cli import main as cli_main
from ti_schema import validate_events
from ti_schema.layout import EVENT_PARTS, EVENTS_FILE, HISTORY_PARTS

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from datetime import UTC, datetime

    import pyarrow as pa
    import torch
    from torch import nn

    from ti_core import AlwaysSampler, inject_observer
    from ti_io import DirectorySink, HistoryConfig
    from ti_schema import events_schema

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    sink = DirectorySink(sys.argv[1], history_config=HistoryConfig(flush_seconds=None))
    inject_observer(model, sink=sink, sampler=AlwaysSampler())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    sink.flush()  # the history so far is published; what follows is not
    row = {
        "run_id": "crash", "rank": 0, "event_id": 0, "kind": "manual", "forward_index": 2,
        "timestamp": datetime.now(UTC), "signal": None, "layer": None, "module_type": None,
        "tensor_path": None, "layers": [], "tensor_paths": [], "reason": "about to die",
        "value": None, "dense_first_forward": 3, "dense_forwards": 4,
        "replay": None, "replay_reason": None,
    }
    schema = events_schema("crash test")
    batch = pa.table({k: [v] for k, v in row.items()}, schema=schema).to_batches()[0]
    sink.capabilities().write_events(batch)
    os.kill(os.getpid(), signal.SIGKILL)  # right after: no flush, no finalization, no atexit
    """
)


def test_an_event_written_just_before_kill_9_is_recovered_by_consolidate(tmp_path: Path) -> None:
    out = tmp_path / "stats"
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert (out / HISTORY_PARTS).is_dir()
    assert not (out / EVENTS_FILE).exists()
    live = read_events(out)
    assert live.column("reason").to_pylist() == ["about to die"]
    history_before = scan_history(out).collect().height
    assert history_before > 0
    assert cli_main(["consolidate", str(out)]) == 0
    assert not (out / EVENT_PARTS).exists()
    table = pq.read_table(out / EVENTS_FILE)
    validate_events(table, metadata=pq.read_metadata(out / EVENTS_FILE).metadata)
    assert table.column("kind").to_pylist() == ["manual"]
    assert table.column("dense_first_forward").to_pylist() == [3]
    assert scan_history(out).collect().height == history_before
    assert cli_main(["validate", str(out)]) == 0
    assert "1 event(s)" in (out / "index.md").read_text()
