"""The artifact-directory checker behind ``ti validate`` and ``assert_artifact_dir_conforms``.

One run directory, or a directory of rank-private runs (:mod:`ti_schema.layout`), is checked
file by file against the contract: every Parquet file (final or part) against its schema with
the ``ti`` metadata of its footer, the ``rank`` values of a rank directory's rows, result.json
(strict JSON and its schema), and the presence of what a run always holds. Every problem is
collected; nothing stops at the first.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ti_schema.layout import (
    EVENT_PARTS,
    EVENTS_FILE,
    HISTOGRAM_PARTS,
    HISTOGRAMS_FILE,
    HISTORY_FILE,
    HISTORY_PARTS,
    INDEX_FILE,
    JOURNAL_FILE,
    RESULT_FILE,
    list_parts,
    list_rank_dirs,
    rank_dir_name,
)
from ti_schema.result_json import load_strict_json, result_json_problems
from ti_schema.validate import (
    EVENTS_CONTRACT,
    HISTOGRAMS_CONTRACT,
    HISTORY_CONTRACT,
    Contract,
    row_group_problems,
)


@dataclass(frozen=True)
class ArtifactProblem:
    """One problem with one file (or directory) of a run."""

    path: Path
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


RowGroupReader = Callable[[Path], Iterator[pa.Table]]
"""``read(path)``: the row groups of a Parquet file, in order (``ti validate`` passes one that
also verifies page checksums)."""


def read_row_groups(path: Path) -> Iterator[pa.Table]:
    """Every row group of ``path``, one at a time (the default :data:`RowGroupReader`)."""
    with pq.ParquetFile(path) as source:
        for index in range(source.metadata.num_row_groups):
            yield source.read_row_group(index)


def _check_parquet(
    path: Path,
    contract: Contract,
    rank: int | None,
    problems: list[ArtifactProblem],
    read: RowGroupReader,
) -> None:
    """The contract's problems with the Parquet file ``path``, read a row group at a time
    (memory does not grow with the file)."""
    ranks: set[int] = set()

    def row_groups() -> Iterator[pa.Table]:
        for table in read(path):
            if rank is not None and "rank" in table.column_names and table.num_rows:
                held: list[Any] = pc.unique(table.column("rank")).to_pylist()
                ranks.update(r for r in held if r is not None)
            yield table

    try:
        metadata = pq.read_metadata(path)
        # The Parquet footer holds `ti` whoever wrote the file; pyarrow's reconstructed Arrow
        # schema lacks it for files written by Polars.
        found = row_group_problems(
            row_groups(), contract, metadata.schema.to_arrow_schema(), metadata=metadata.metadata
        )
    except (OSError, pa.ArrowException, ValueError) as exc:
        problems.append(ArtifactProblem(path, f"cannot be read as Parquet ({exc})"))
        return
    problems.extend(ArtifactProblem(path, str(m)) for m in found)
    if rank is not None and ranks and sorted(ranks) != [rank]:
        problems.append(
            ArtifactProblem(
                path, f"sits in {rank_dir_name(rank)}/ but holds rank values {sorted(ranks)}"
            )
        )


def _check_run_dir(
    directory: Path,
    rank: int | None,
    allow_live: bool,
    problems: list[ArtifactProblem],
    read: RowGroupReader,
) -> None:
    history = directory / HISTORY_FILE
    parts_dir = directory / HISTORY_PARTS
    if not allow_live and (directory / JOURNAL_FILE).exists():
        problems.append(
            ArtifactProblem(
                directory / JOURNAL_FILE,
                "present: a finalization of this run did not finish (run `ti consolidate DIR`, "
                "which resumes it)",
            )
        )
    if history.is_file():
        _check_parquet(history, HISTORY_CONTRACT, rank, problems, read)
    elif parts_dir.is_dir():
        if not allow_live:
            problems.append(
                ArtifactProblem(
                    history,
                    f"missing; {HISTORY_PARTS}/ is there, so the run was not consolidated "
                    "(run `ti consolidate DIR`)",
                )
            )
    else:
        problems.append(ArtifactProblem(history, "missing"))
    for part in list_parts(parts_dir):
        _check_parquet(part, HISTORY_CONTRACT, rank, problems, read)
    histograms = directory / HISTOGRAMS_FILE
    if histograms.is_file():
        _check_parquet(histograms, HISTOGRAMS_CONTRACT, rank, problems, read)
    for part in list_parts(directory / HISTOGRAM_PARTS):
        _check_parquet(part, HISTOGRAMS_CONTRACT, rank, problems, read)
    events = directory / EVENTS_FILE
    if events.is_file():
        _check_parquet(events, EVENTS_CONTRACT, rank, problems, read)
    for part in list_parts(directory / EVENT_PARTS):
        _check_parquet(part, EVENTS_CONTRACT, rank, problems, read)
    result = directory / RESULT_FILE
    if not result.is_file():
        problems.append(ArtifactProblem(result, "missing"))
    else:
        try:
            data = load_strict_json(result)
        except ValueError as exc:
            problems.append(ArtifactProblem(result, f"not strict JSON ({exc})"))
        else:
            problems.extend(ArtifactProblem(result, str(m)) for m in result_json_problems(data))
    if not (directory / INDEX_FILE).is_file():
        problems.append(ArtifactProblem(directory / INDEX_FILE, "missing"))


def artifact_dir_problems(
    path: str | os.PathLike[str],
    *,
    allow_live: bool = False,
    read: RowGroupReader = read_row_groups,
) -> list[ArtifactProblem]:
    """Every way the run directory ``path`` breaks the contract; empty when it conforms.

    A run holds history.parquet, result.json and index.md; histograms.parquet, events.parquet
    and the parts in ``history.parts/``,
    ``histograms.parts/`` and ``events.parts/`` are checked when present. A directory of
    rank-private runs (``rank-000/``, ``rank-001/``, ...) is checked rank by rank, and each
    rank's rows must carry its own ``rank``. ``allow_live``: a run that has ``history.parts/``
    but no history.parquet yet (live, or interrupted before ``ti consolidate``) conforms when
    its parts do, and so does one whose finalization was interrupted (the finalization journal
    is there: the files written so far and the parts are checked); otherwise both are reported
    as not consolidated. ``read``: how a Parquet file's row groups are read (each file is
    checked a row group at a time, so memory does not grow with the run). Raises
    NotADirectoryError when ``path`` is not a directory.
    """
    root = Path(path)
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    if not isinstance(allow_live, bool):
        raise TypeError(f"allow_live= must be True or False, got {allow_live!r}")
    problems: list[ArtifactProblem] = []
    ranks = list_rank_dirs(root)
    if ranks:
        for rank, child in ranks:
            _check_run_dir(child, rank, allow_live, problems, read)
    else:
        _check_run_dir(root, None, allow_live, problems, read)
    return problems
