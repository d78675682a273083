"""A training process that only writes parts does not load Polars (about 22 MB of RSS):
``import ti_io`` and the sink's open, writes and flush stay on the write side; finalization,
which reads, loads it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CODE = """
import sys
import ti_io
from ti_io import DirectorySink
from ti_schema.testing import example_history_table, example_run_info

assert "polars" not in sys.modules, "import ti_io loaded polars"
sink = DirectorySink(sys.argv[1])
sink.open(example_run_info())
for batch in example_history_table().to_batches():
    sink.write_history(batch)
sink.flush()
assert "polars" not in sys.modules, "writing parts loaded polars"
sink.close()
assert "polars" in sys.modules, "finalization did not read with polars"
print(ti_io.scan_history(sys.argv[1]).collect().height)
"""


def test_writing_parts_does_not_load_polars_until_finalization(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CODE, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "54"  # every row written is in the finished history
    assert (tmp_path / "run" / "history.parquet").is_file()


def test_every_public_name_resolves() -> None:
    import ti_io

    for name in ti_io.__all__:
        assert getattr(ti_io, name) is not None, name
    assert set(ti_io.__all__) <= set(dir(ti_io))
