"""``validate_run``: every way a run directory is damaged or breaks the contract (``ti validate``).

Two checks in one read, every problem collected: each Parquet file of the run (final files and
parts, of every rank) is read a row group at a time with its page checksums verified
(:mod:`ti_io.integrity`), so a truncated file, a footer that does not parse, a page that fails
its checksum or cannot be decoded is named with what is wrong; the same row groups are checked
against the contract (``ti_schema.artifact_dir_problems``: schemas, footers, ranks,
result.json, what a run holds). Memory holds a row group, whatever the run's length. A damaged
file is reported once, as damaged. Files written without page checksums are read but cannot be
verified: one note says how many. Parts a consolidation skipped as damaged (``damaged/``) are a
note as well.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from ti_io.damaged import gap_lines, parts_dirs, read_skipped
from ti_io.finish.journal import interrupted_finalizations
from ti_io.integrity import (
    DamagedFileError,
    has_page_checksums,
    open_verified,
    parquet_problem,
    read_error,
)
from ti_io.progress import ProgressCallback, Steps
from ti_schema.artifacts import artifact_dir_problems
from ti_schema.layout import RUN_FILES, list_parts, list_rank_dirs

if TYPE_CHECKING:
    from ti_io.storage import RunLocation


@dataclass(frozen=True)
class RunValidation:
    """What :func:`validate_run` found."""

    directory: Path | str
    """The run checked (its URI for a run on object storage)."""
    problems: tuple[str, ...]
    """One line per problem, ``PATH: what is wrong``; empty when the run is whole."""
    notes: tuple[str, ...]
    """Facts to know that are not problems (unverifiable files, interrupted finalizations,
    parts a consolidation skipped)."""
    unverified: tuple[Path | str, ...]
    """Files written without page checksums (read, but not verifiable); URIs for a run on
    object storage."""

    @property
    def ok(self) -> bool:
        return not self.problems


def _parquet_files(run: Path) -> list[Path]:
    finals = [run / name for name in RUN_FILES if name.endswith(".parquet")]
    files = [path for path in finals if path.is_file()]
    for parts in parts_dirs(run):
        files += list_parts(parts)
    return files


def _validate_remote(location: RunLocation, progress: ProgressCallback | None) -> RunValidation:
    # The path-based checks run on a read-only copy; what they say names the store's URIs.
    from ti_io.read.remote import local_copy, shown

    with local_copy(location) as copy:
        found = validate_run(copy, progress=progress)

        def named(text: str) -> str:
            return shown(text, copy, location.uri)

    return replace(
        found,
        directory=location.uri,
        problems=tuple(named(p) for p in found.problems),
        notes=tuple(named(n) for n in found.notes),
        unverified=tuple(named(str(p)) for p in found.unverified),
    )


def _footer_rows(path: Path) -> int:
    """Rows ``path``'s footer records (0 when it cannot be read: the checks say why)."""
    try:
        return int(pq.read_metadata(path).num_rows)
    except (OSError, pa.ArrowException):
        return 0


def _verified_row_groups(path: Path, unverified: list[Path]) -> Iterator[pa.Table]:
    """Every row group of ``path``, its pages checked against their checksums
    (``DamagedFileError`` naming what is wrong); ``path`` is added to ``unverified`` when it
    was written without checksums."""
    strings = [f.name for f in pq.read_schema(path) if pa.types.is_string(f.type)]
    source = open_verified(path, read_dictionary=strings)  # repeated strings stay encoded
    with source:
        try:
            if not has_page_checksums(path, source.metadata):
                unverified.append(path)
            for index in range(source.metadata.num_row_groups):
                yield source.read_row_group(index, use_threads=True)
        except (OSError, pa.ArrowException) as exc:
            if isinstance(exc, FileNotFoundError | PermissionError):
                raise
            raise read_error(path, exc) from None


def validate_run(
    path: str | os.PathLike[str] | RunLocation, *, progress: ProgressCallback | None = None
) -> RunValidation:
    """Check the run (or directory of ``rank-NNN`` runs) at ``path``: every Parquet file read
    whole with page checksums verified, then the contract. Live and interrupted runs are
    checked as they stand. Raises NotADirectoryError when ``path`` is not a directory.

    ``path`` may be a run on object storage (a URI such as ``s3://bucket/run``, or a
    ``ti_io.RunLocation``): its objects are listed once and read (never written) into a private
    temporary copy that the same checks read; problems name the objects' URIs.
    ``FileNotFoundError`` when nothing is stored there, ``OSError`` naming the URI when the
    store cannot be read. ``progress(done, total)`` is told the rows read."""
    from ti_io.read.remote import local_path, remote_location

    remote = remote_location(path)
    if remote is not None:
        return _validate_remote(remote, progress)
    root = local_path(path)
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    runs = [child for _, child in list_rank_dirs(root)] or [root]
    problems: list[str] = []
    notes: list[str] = []
    damaged: dict[Path, str] = {}
    unverified: list[Path] = []
    checked: set[Path] = set()
    files = [file for run in runs for file in _parquet_files(run)]
    steps = Steps(progress, sum(_footer_rows(file) for file in files))

    def read(path: Path) -> Iterator[pa.Table]:
        # The contract's check reads each file once, a row group at a time: that read verifies
        # the page checksums too, so every page is read once in all.
        checked.add(path)
        try:
            for table in _verified_row_groups(path, unverified):
                steps.advance(table.num_rows)
                yield table
        except DamagedFileError as exc:
            damaged[path] = exc.problem
            raise
        except OSError as exc:
            damaged[path] = f"it cannot be read ({exc})"
            raise

    mismatches = artifact_dir_problems(root, allow_live=True, read=read)
    for run in runs:
        for file in _parquet_files(run):
            if file not in checked:  # a file the contract check does not read
                problem, checksummed = parquet_problem(file)
                if problem is not None:
                    damaged[file] = problem
                elif not checksummed:
                    unverified.append(file)
        gap = gap_lines(read_skipped(run))
        if gap:
            notes.append(f"{run}: " + "; ".join(gap))
    for run in runs:
        for file in _parquet_files(run):
            if file in damaged:
                problems.append(f"{file}: damaged: {damaged[file]}")
    for mismatch in mismatches:
        if mismatch.path not in damaged:
            problems.append(str(mismatch))
    journal_problems, interrupted = interrupted_finalizations(root)
    problems += journal_problems
    notes += interrupted
    if unverified:
        shown = ", ".join(str(p) for p in unverified[:3])
        notes.insert(
            0,
            f"{len(unverified)} Parquet file(s) have no page checksums (written before ti-io "
            f"wrote them) and cannot be verified: {shown}{', ...' if len(unverified) > 3 else ''}",
        )
    return RunValidation(root, tuple(problems), tuple(notes), tuple(unverified))


__all__ = ["RunValidation", "validate_run"]
