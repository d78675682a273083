"""Names of the artifacts in a run directory, and atomic publication of files.

Every file a reader may open is written under a temporary name in the same directory, fsynced,
then renamed over its final name (``os.replace``), so a reader (or a process killed with
SIGKILL) only ever sees complete files. Temporary names start with ``.`` and end in
``.ti-tmp`` so globs such as ``*.parquet`` never match them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

HISTORY_FILE: Final[str] = "history.parquet"
HISTOGRAMS_FILE: Final[str] = "histograms.parquet"
RESULT_FILE: Final[str] = "result.json"
INDEX_FILE: Final[str] = "index.md"
HISTORY_PARTS: Final[str] = "history.parts"
HISTOGRAM_PARTS: Final[str] = "histograms.parts"
TENSORBOARD_DIR: Final[str] = "tensorboard"
RUN_FILE: Final[str] = "run.json"
"""Run facts kept inside ``history.parts/`` while the run is unconsolidated."""

FILES: Final[tuple[str, ...]] = (HISTORY_FILE, HISTOGRAMS_FILE, RESULT_FILE, INDEX_FILE)
DIRS: Final[tuple[str, ...]] = (HISTORY_PARTS, HISTOGRAM_PARTS, TENSORBOARD_DIR)
ARTIFACTS: Final[tuple[str, ...]] = FILES + DIRS
"""Every top-level entry a run owns; their presence marks a directory as holding a run."""

PART: Final[re.Pattern[str]] = re.compile(r"part-(\d{6,})\.parquet")
TEMP: Final[re.Pattern[str]] = re.compile(r"\..+\.ti-tmp")
EVENTS: Final[re.Pattern[str]] = re.compile(r"events\.out\.tfevents\..+")
RANK_DIR: Final[re.Pattern[str]] = re.compile(r"rank-\d{3,}")

_counter = itertools.count()
_counter_lock = threading.Lock()


def part_name(index: int) -> str:
    """File name of part ``index``: ``part-000042.parquet`` (sorts numerically up to 10**6)."""
    return f"part-{index:06d}.parquet"


def list_parts(directory: Path) -> list[Path]:
    """Published parts in ``directory``, in part order; temporaries and strangers ignored."""
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = PART.fullmatch(child.name)
        if match and child.is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def present_artifacts(directory: Path) -> list[str]:
    """Names of the run artifacts that exist in ``directory`` (temporaries included)."""
    if not directory.is_dir():
        return []
    names = [name for name in ARTIFACTS if (directory / name).exists()]
    names += sorted(c.name for c in directory.iterdir() if TEMP.fullmatch(c.name))
    return names


def temp_path(final: Path) -> Path:
    """A fresh temporary path beside ``final`` (same directory, so the rename is atomic)."""
    with _counter_lock:
        n = next(_counter)
    return final.with_name(f".{final.name}.{os.getpid()}-{threading.get_ident()}-{n}.ti-tmp")


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every platform allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
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


def publish_text(final: Path, text: str) -> None:
    """Atomically replace ``final`` with ``text`` (UTF-8)."""
    with publishing(final) as tmp:
        tmp.write_text(text, encoding="utf-8")


def publish_with(final: Path, write: Callable[[Path], None]) -> None:
    """Atomically replace ``final`` with what ``write(tmp_path)`` writes."""
    with publishing(final) as tmp:
        write(tmp)


def remove_run_artifacts(directory: Path) -> None:
    """Remove exactly the files a run owns in ``directory``; anything else stays.

    Parts, run facts, TensorBoard event files and our temporaries go; a directory of ours is
    removed only once empty, so a stranger's file inside it survives.
    """
    for name in FILES:
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()
    for child in list(directory.iterdir()) if directory.is_dir() else []:
        if TEMP.fullmatch(child.name):
            if child.is_dir():
                remove_owned_dir(child)
            else:
                child.unlink()
    for name, owned in (
        (HISTORY_PARTS, (PART, TEMP, re.compile(re.escape(RUN_FILE)))),
        (HISTOGRAM_PARTS, (PART, TEMP)),
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
    """Remove a parts directory: our parts, temporaries and run facts; rmdir when empty."""
    owned = (PART, TEMP, re.compile(re.escape(RUN_FILE)))
    for child in list(path.iterdir()):
        if child.is_file() and any(p.fullmatch(child.name) for p in owned):
            with contextlib.suppress(FileNotFoundError):
                child.unlink()
    with contextlib.suppress(OSError):
        path.rmdir()


def retire_dir(path: Path) -> None:
    """Remove a consolidated parts directory: first rename it atomically to a temporary name
    (so a crash midway never leaves a half-emptied ``*.parts/`` that looks unconsolidated),
    then remove what we own in it."""
    if not path.is_dir():
        return
    tmp = temp_path(path)
    os.replace(path, tmp)
    fsync_dir(path.parent)
    remove_owned_dir(tmp)
