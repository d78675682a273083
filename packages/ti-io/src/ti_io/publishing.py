"""Atomic publication of a run's files, and removal of exactly the files a run owns.

Every file a reader may open is written under a temporary name in the same directory, fsynced,
then renamed over its final name (``os.replace``), so a reader (or a process killed with
SIGKILL) only ever sees complete files. Temporary names start with ``.`` and end in
``.ti-tmp`` so globs such as ``*.parquet`` never match them. The names of the files and their
layout are ti-schema's (:mod:`ti_schema.layout`).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

from ti_io import storage
from ti_io.storage import RunLocation
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

TEMP: Final[re.Pattern[str]] = re.compile(r"\..+\.ti-tmp")
"""Our temporaries (see :func:`temp_path`)."""
EVENTS: Final[re.Pattern[str]] = re.compile(r"events\.out\.tfevents\..+")
"""TensorBoard event files, which a run owns inside ``tensorboard/``."""

_counter = itertools.count()
_counter_lock = threading.Lock()


def present_artifacts(directory: Path) -> list[str]:
    """Names of the run artifacts that exist in ``directory`` (temporaries included)."""
    if not directory.is_dir():
        return []
    names = [name for name in RUN_ENTRIES if (directory / name).exists()]
    names += sorted(c.name for c in directory.iterdir() if TEMP.fullmatch(c.name))
    return names


def temp_path(final: Path) -> Path:
    """A fresh temporary path beside ``final`` (same directory, so the rename is atomic)."""
    with _counter_lock:
        n = next(_counter)
    return final.with_name(f".{final.name}.{os.getpid()}-{threading.get_ident()}-{n}.ti-tmp")


_NO_DIRECTORY_SYNC: Final[frozenset[int]] = frozenset(
    {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EISDIR, errno.EACCES}
)
"""Errors that say a directory cannot be opened or synced here (Windows, some network and
FUSE file systems), not that the disk failed."""


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable.

    Where the platform cannot sync a directory (:data:`_NO_DIRECTORY_SYNC`) this is skipped;
    any other failure (EIO, ENOSPC) is raised: the rename may not survive a power loss.
    """
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as exc:
        if exc.errno in _NO_DIRECTORY_SYNC:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIRECTORY_SYNC:
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def publishing(final: Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success fsync it and rename it over ``final``.

    On error the temporary file is removed and ``final`` is left as it was.
    """
    tmp = temp_path(final)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(final.parent)


def publish_text(final: Path | RunLocation, text: str) -> None:
    """Atomically replace ``final`` with ``text`` (UTF-8); on an object store, one object
    (:func:`ti_io.storage.publish_text`)."""
    if isinstance(final, RunLocation):
        if final.local_path is None:
            storage.publish_text(final, text)
            return
        final = final.local_path
    with publishing(final) as tmp:
        tmp.write_text(text, encoding="utf-8")


def publish_with(final: Path | RunLocation, write: Callable[[Path], None]) -> None:
    """Atomically replace ``final`` with what ``write(tmp_path)`` writes; on an object store,
    one object uploaded from a local temporary file (:func:`ti_io.storage.publish_with`)."""
    if isinstance(final, RunLocation):
        if final.local_path is None:
            storage.publish_with(final, write)
            return
        final = final.local_path
    with publishing(final) as tmp:
        write(tmp)


def remove_run_artifacts(directory: Path) -> None:
    """Remove exactly the files a run owns in ``directory``; anything else stays.

    Parts, run facts, TensorBoard event files and our temporaries go; a directory of ours is
    removed only once empty, so a stranger's file inside it survives.
    """
    for name in RUN_FILES:
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()
    for child in list(directory.iterdir()) if directory.is_dir() else []:
        if TEMP.fullmatch(child.name):
            if child.is_dir():
                remove_owned_dir(child)
            else:
                child.unlink()
    for name, owned in (
        (HISTORY_PARTS, (PART_PATTERN, TEMP, re.compile(re.escape(RUN_FILE)))),
        (HISTOGRAM_PARTS, (PART_PATTERN, TEMP)),
        (EVENT_PARTS, (PART_PATTERN, TEMP)),
        (TENSORBOARD_DIR, (EVENTS,)),
    ):
        sub = directory / name
        if not sub.is_dir():
            continue
        for child in list(sub.iterdir()):
            if child.is_file() and any(p.fullmatch(child.name) for p in owned):
                child.unlink()
        with contextlib.suppress(OSError):
            sub.rmdir()


def remove_owned_dir(path: Path) -> None:
    """Remove a parts directory: our parts, temporaries and run facts; rmdir when empty (a
    stranger's file keeps it, and it is left in place)."""
    owned = (PART_PATTERN, TEMP, re.compile(re.escape(RUN_FILE)))
    for child in list(path.iterdir()):
        if child.is_file() and any(p.fullmatch(child.name) for p in owned):
            with contextlib.suppress(FileNotFoundError):
                child.unlink()
    try:
        path.rmdir()
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            raise


def remove_stale_temporaries(directory: Path) -> int:
    """Remove the temporaries that interrupted writes left in a run directory and in its parts
    directories (files, and parts directories renamed away to be retired); returns how many.

    Only for a finalizer holding the run (``ti_io.finish.finalization``): no writer of the run
    may be running, or its temporary in flight would go.
    """
    removed = 0
    for folder in (
        directory,
        directory / HISTORY_PARTS,
        directory / HISTOGRAM_PARTS,
        directory / EVENT_PARTS,
        directory / "damaged",  # ti_io.damaged.DAMAGED_DIR: the record of skipped parts
    ):
        if not folder.is_dir():
            continue
        for child in list(folder.iterdir()):
            if not TEMP.fullmatch(child.name):
                continue
            if child.is_dir():
                remove_owned_dir(child)
            else:
                with contextlib.suppress(FileNotFoundError):
                    child.unlink()
            removed += 1
    return removed
