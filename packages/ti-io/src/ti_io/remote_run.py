"""What a run owns under an object-store prefix: finding it, removing exactly it, copying it.

The object-store counterpart of :func:`ti_io.publishing.present_artifacts` and
:func:`~ti_io.publishing.remove_run_artifacts`. There are no directories: a prefix "exists"
while an object is under it, and pyarrow may leave an empty directory-marker object
(``history.parts/``) behind a delete, so a run's parts are the objects whose names match
``part-NNNNNN.parquet``, never the presence of a prefix. Listing a run is one list request
per level and 1,000 objects (S3).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Final

from ti_io.publishing import EVENTS
from ti_io.storage import RunLocation, delete_files, download, list_files, list_names
from ti_schema.layout import (
    EVENT_PARTS,
    HISTOGRAM_PARTS,
    HISTORY_PARTS,
    PART_PATTERN,
    RUN_ENTRIES,
    RUN_FILE,
    RUN_FILES,
    TENSORBOARD_DIR,
)

PARTS_DIRS: Final[tuple[str, ...]] = (HISTORY_PARTS, HISTOGRAM_PARTS, EVENT_PARTS)
_OWNED: Final[tuple[tuple[str, tuple[re.Pattern[str], ...]], ...]] = (
    (HISTORY_PARTS, (PART_PATTERN, re.compile(re.escape(RUN_FILE)))),
    (HISTOGRAM_PARTS, (PART_PATTERN,)),
    (EVENT_PARTS, (PART_PATTERN,)),
    (TENSORBOARD_DIR, (EVENTS,)),
)
"""The objects a run owns below its prefix, by sub-prefix."""


def present_objects(location: RunLocation) -> list[str]:
    """Names of the run entries under ``location`` (one listing; a sub-prefix counts when it
    holds an object of the run)."""
    names = set(list_names(location))
    found = [name for name in RUN_FILES if name in names]
    for name, owned in _OWNED:
        if name in names and _owned(location / name, owned):
            found.append(name)
    return [name for name in RUN_ENTRIES if name in found]


def _owned(location: RunLocation, patterns: Iterable[re.Pattern[str]]) -> list[str]:
    patterns = tuple(patterns)
    return [
        info.path
        for info in list_files(location)
        if any(p.fullmatch(PurePosixPath(info.path).name) for p in patterns)
    ]


def part_paths(location: RunLocation, parts_dir: str) -> list[str]:
    """The parts in ``location/parts_dir`` (filesystem paths), in index order."""
    found = []
    for info in list_files(location / parts_dir):
        match = PART_PATTERN.fullmatch(PurePosixPath(info.path).name)
        if match:
            found.append((int(match.group(1)), info.path))
    return [path for _, path in sorted(found)]


def remove_run_objects(location: RunLocation) -> int:
    """Delete exactly the objects a run owns under ``location`` (its files, parts, run facts,
    TensorBoard event files); anything else stays. Returns how many were deleted."""
    fs = location.filesystem
    paths = [f"{location.path}/{name}" for name in RUN_FILES]
    for name, owned in _OWNED:
        paths += _owned(location / name, owned)
    return delete_files(fs, paths)


def retire_parts(location: RunLocation) -> int:
    """Delete the parts (and run.json) of ``location``: the last step of finalization, once the
    final files are published. Returns how many objects were deleted.

    A parts prefix that holds only the run's objects goes in one batched delete (S3's
    DeleteObjects, 1,000 keys a request, and pyarrow's directory marker with it); one that also
    holds a stranger's object loses only the run's, one DELETE each.
    """
    fs = location.filesystem
    deleted = 0
    for name, owned in _OWNED[:3]:
        files = list_files(location / name)
        mine = [
            info.path
            for info in files
            if any(p.fullmatch(PurePosixPath(info.path).name) for p in owned)
        ]
        if not mine:
            continue
        if len(mine) == len(files):
            fs.delete_dir((location / name).path)
            deleted += len(mine)
        else:
            deleted += delete_files(fs, mine)
    return deleted


def stage(location: RunLocation, local: Path, names: Iterable[str]) -> list[str]:
    """Download the objects ``names`` (relative to ``location``; missing ones skipped) into
    the same relative places under the local directory ``local``; returns those copied."""
    copied = []
    for name in names:
        target = local / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            download(location / name, target)
        except FileNotFoundError:
            continue
        copied.append(name)
    return copied


def relative(location: RunLocation, path: str) -> str:
    """``path`` (a filesystem path below ``location``) relative to ``location``."""
    prefix = location.path.rstrip("/") + "/"
    if not path.startswith(prefix):
        raise ValueError(f"{path} is not below {location.path}")
    return path[len(prefix) :]


__all__ = [
    "PARTS_DIRS",
    "part_paths",
    "present_objects",
    "relative",
    "remove_run_objects",
    "retire_parts",
    "stage",
]
