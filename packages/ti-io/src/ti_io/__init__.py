"""ti-io: the artifacts of an observed run.

``DirectorySink`` writes live Parquet parts, ``history.parquet``, ``histograms.parquet``,
``result.json``, ``index.md`` and TensorBoard events; ``TensorBoardSink`` adds the histograms
to a caller-owned TensorBoard writer; ``scan_history`` and ``consolidate`` read and finish runs;
``compare_runs`` / ``compare_series`` line matched runs up by sample id; ``upgrade`` converts a
run written by torchinstruments 0.8.0.
``inject_observer(model, output_dir=...)`` finds ``DirectorySink`` through the ``ti.sinks``
entry point, so ti-core never imports this package.
"""

from __future__ import annotations

from ti_io.compare import ComparedRun, compare_runs, compare_series, open_runs, unshared
from ti_io.config import HistoryConfig
from ti_io.consolidate import Consolidated, consolidate
from ti_io.directory_sink import DirectorySink
from ti_io.errors import (
    ArtifactWriteError,
    FinalizationBusyError,
    FinalizationError,
    NothingToConsolidateError,
    ShrinkRefusedError,
)
from ti_io.legacy import Upgraded, UpgradedRun, UpgradeError, upgrade
from ti_io.legacy_layout import LegacyRunError, legacy_reason
from ti_io.progress import ProgressCallback
from ti_io.readers import scan_history
from ti_io.tags import histogram_tag
from ti_io.tensorboard_sink import TensorBoardSink

__all__ = [
    "ArtifactWriteError",
    "ComparedRun",
    "Consolidated",
    "DirectorySink",
    "FinalizationBusyError",
    "FinalizationError",
    "HistoryConfig",
    "LegacyRunError",
    "NothingToConsolidateError",
    "ProgressCallback",
    "ShrinkRefusedError",
    "TensorBoardSink",
    "UpgradeError",
    "Upgraded",
    "UpgradedRun",
    "compare_runs",
    "compare_series",
    "consolidate",
    "histogram_tag",
    "legacy_reason",
    "open_runs",
    "scan_history",
    "unshared",
    "upgrade",
]
