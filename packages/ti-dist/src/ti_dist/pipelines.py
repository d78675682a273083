"""The rows of a pipeline-parallel job, each with its stage, step and microbatch
(``ti_schema.pipeline``; recorded by ``ti_core.inject_stage_observer``)."""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl

from ti_dist.reading import _scan, find_history_sources
from ti_io.facts import recorded_settings
from ti_schema import pipeline_stage_of


def pipeline_rows(output_dir: str | os.PathLike[str]) -> pl.LazyFrame:
    """Every rank's ``ti.history`` rows under ``output_dir`` (as :func:`scan_ranks`) with
    three more columns: ``pipeline_stage``, ``step`` and ``microbatch`` (Int64), from each
    rank's recorded stage and microbatch count: ``step, microbatch = divmod(forward_index,
    microbatches)``. Null on a rank that was not observed as a pipeline stage. A local
    directory (live, killed or finalized ranks)."""
    sources = find_history_sources(Path(output_dir))
    if not sources:
        raise FileNotFoundError(
            f"no history found under output_dir {str(output_dir)!r}: expected rank-NNN/ "
            "subfolders holding history.parquet or history.parts/"
        )
    frames = []
    for source in sources:
        facts = pipeline_stage_of(recorded_settings(source.directory))
        frame = _scan(source)
        if facts is None:
            extra = [
                pl.lit(None, pl.Int64).alias(c) for c in ("pipeline_stage", "step", "microbatch")
            ]
        else:
            index = pl.col("forward_index")
            extra = [
                pl.lit(facts.stage, pl.Int64).alias("pipeline_stage"),
                (index // facts.microbatches).alias("step"),
                (index % facts.microbatches).alias("microbatch"),
            ]
        frames.append(frame.with_columns(extra))
    return frames[0] if len(frames) == 1 else pl.concat(frames, how="vertical")


__all__ = ["pipeline_rows"]
