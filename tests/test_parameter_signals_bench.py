"""Smoke test of benchmarks/parameter_signals.py: it runs end to end on ``sequence``, times every
configuration, and its runs sampling every step record the rows the contract predicts.

No timing is asserted (the figures are in benchmarks/README.md, "Parameter signals").
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ti_schema import DEFAULT_METRICS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "parameter_signals.py"

pytest.importorskip("ti_io")


def test_tiny_sequence_run_reports_every_configuration() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--workloads",
            "sequence",
            "--pairs",
            "1",
            "--steps",
            "1",
            "--sampled-steps",
            "1",
            "--samples",
            "2",
            "--no-wandb",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    text = done.stdout
    for config in (
        "unsampled outputs",
        "unsampled all five",
        "sampled outputs",
        "sampled all five",
    ):
        assert re.search(rf"^  {config} +[0-9.]+ ms +[0-9.]+x", text, re.MULTILINE), text
    rows = dict(re.findall(r"data per sample, (outputs|all five) .* (\d+) history rows", text))
    # 4 Linear layers x (output, output_gradient) x the metrics; all five adds their weight and
    # bias x (parameter, parameter_gradient, parameter_update) x the metrics.
    m = len(DEFAULT_METRICS)
    assert rows == {"outputs": str(4 * 2 * m), "all five": str(4 * 2 * m + 4 * 2 * 3 * m)}
