"""Reading a run that lives on object storage (any pyarrow filesystem but the local disk).

Every reader starts from one listing of the run's prefix (:func:`list_run`): a recursive
``FileSelector``, which an object store answers with a few list calls of up to 1,000 keys each
however many ``rank-NNN/`` prefixes the run holds, never one listing per folder. Readers never
write to the store.

- :class:`RunObjects`: that listing, asked what the local readers ask a directory (is this a
  file, the published parts of a folder, the rank folders).
- :func:`scan_objects`: a LazyFrame over objects, each verified first (its Parquet page
  checksums, :func:`ti_io.integrity.verify_objects`), read through the filesystem.
- :func:`local_copy`: the run's objects copied into a private temporary directory, for the
  readers that work on files (``ti summary``, ``ti validate``, ``ti compare``, ``ti upgrade``'s
  source); removed afterwards. :func:`shown` names the copy's paths by the run's URI again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final

import polars as pl
import pyarrow.fs as pafs

from ti_io.integrity import verify_objects
from ti_io.storage import RunLocation, StorageError, resolve_location, storage_error
from ti_schema.layout import HISTORY_FILE, HISTORY_PARTS, part_index, rank_of_dir

_COPY_CHUNK: Final[int] = 8 << 20


@dataclass(frozen=True)
class RunObjects:
    """Every object under a run's prefix, from one listing (:func:`list_run`).

    ``files`` maps each object's path relative to the run (``/``-separated) to its listed
    ``FileInfo``; ``dirs`` holds every folder those paths imply (object stores have no
    folders of their own).
    """

    location: RunLocation
    files: Mapping[str, pafs.FileInfo]
    dirs: frozenset[str]

    def uri(self, relative: str = "") -> str:
        """The URI of ``relative`` (a path inside the run)."""
        base = self.location.uri.rstrip("/")
        return f"{base}/{relative}" if relative else base

    def is_file(self, relative: str) -> bool:
        return relative in self.files

    def is_dir(self, relative: str) -> bool:
        return relative in self.dirs

    def _children(self, folder: str) -> Iterator[str]:
        prefix = f"{folder}/" if folder else ""
        for name in self.files:
            if name.startswith(prefix) and "/" not in name[len(prefix) :]:
                yield name

    def parts(self, folder: str) -> list[str]:
        """The published parts directly in ``folder``, in part order (as ``list_parts``)."""
        found = []
        for name in self._children(folder):
            index = part_index(PurePosixPath(name).name)
            if index is not None:
                found.append((index, name))
        return [name for _, name in sorted(found)]

    def rank_dirs(self) -> list[tuple[int, str]]:
        """``(rank, folder)`` of every ``rank-NNN`` folder of the run, by rank."""
        found = []
        for folder in self.dirs:
            if "/" not in folder:
                rank = rank_of_dir(folder)
                if rank is not None:
                    found.append((rank, folder))
        return sorted(found)

    def history(self, folder: str = "") -> tuple[list[str], bool]:
        """The history objects of ``folder`` as ``scan_history`` picks them: the final file
        (True), else the published parts (False; empty when there are none)."""
        final = f"{folder}/{HISTORY_FILE}" if folder else HISTORY_FILE
        if self.is_file(final):
            return [final], True
        return self.parts(f"{folder}/{HISTORY_PARTS}" if folder else HISTORY_PARTS), False


def remote_location(source: str | os.PathLike[str] | RunLocation) -> RunLocation | None:
    """The location of ``source`` when it is not on the local disk (a URI such as
    ``s3://bucket/run``, or a ``RunLocation`` on another filesystem); None for a local path,
    which the readers then read as they always have (nothing is resolved for a plain path)."""
    if isinstance(source, RunLocation):
        return source if source.local_path is None else None
    if isinstance(source, str) and "://" in source:
        location = resolve_location(source)
        return location if location.local_path is None else None
    return None


def local_path(source: str | os.PathLike[str] | RunLocation) -> Path:
    """``source`` as a local path (a ``file://`` URI or local ``RunLocation`` included)."""
    if isinstance(source, RunLocation):
        assert source.local_path is not None
        return source.local_path
    if isinstance(source, str) and "://" in source:
        resolved = resolve_location(source).local_path
        assert resolved is not None
        return resolved
    return Path(source)


def list_run(location: RunLocation) -> RunObjects:
    """Every object under ``location``, from one recursive listing.

    Raises ``FileNotFoundError`` naming the URI when nothing is stored under it,
    ``ti_io.storage.StorageError`` (an OSError) naming it and what to check when the store
    cannot be listed (no such bucket, refused credentials, an endpoint that does not answer).
    """
    selector = pafs.FileSelector(location.path, recursive=True, allow_not_found=True)
    try:
        infos = location.filesystem.get_file_info(selector)
    except OSError as exc:
        raise storage_error(location, "listing the run", exc) from None
    root = location.path.rstrip("/")
    files: dict[str, pafs.FileInfo] = {}
    dirs: set[str] = set()
    for info in infos:
        relative = info.path[len(root) :].lstrip("/")
        if not relative:
            continue
        if info.type == pafs.FileType.File:
            files[relative] = info
            parent = PurePosixPath(relative).parent
            dirs.update(str(p) for p in (parent, *parent.parents) if str(p) != ".")
        elif info.type == pafs.FileType.Directory:
            dirs.add(relative)
    if not files:
        bucket = root.split("/", 1)[0]
        try:
            gone = location.filesystem.get_file_info(bucket).type == pafs.FileType.NotFound
        except OSError:
            gone = False
        if gone:
            raise StorageError(
                f"{location.uri}: listing the run failed: the bucket {bucket!r} does not "
                "exist: check the bucket name in the URI"
            )
        raise FileNotFoundError(
            f"{location.uri}: no run there (nothing is stored under this prefix); pass a run's "
            "output_dir"
        )
    return RunObjects(location, files, frozenset(dirs))


def scan_objects(objects: RunObjects, names: list[str]) -> pl.LazyFrame:
    """One LazyFrame over the Parquet objects ``names`` (paths inside the run, one schema),
    each verified first (page checksums; ``ti_io.DamagedFileError`` naming its URI), read
    lazily through the run's filesystem (Polars reads only the columns and row groups the
    query needs)."""
    import pyarrow.dataset as ds

    filesystem = objects.location.filesystem
    infos = [objects.files[name] for name in names]
    verify_objects(
        filesystem, [(info, objects.uri(name)) for info, name in zip(infos, names, strict=True)]
    )
    parquet = ds.ParquetFileFormat()
    # The listed sizes spare a HEAD request per object when Polars reads it.
    fragments = [
        parquet.make_fragment(info.path, filesystem, file_size=info.size) for info in infos
    ]
    dataset = ds.FileSystemDataset(fragments, fragments[0].physical_schema, parquet, filesystem)
    return pl.scan_pyarrow_dataset(dataset)


def _copy_all(objects: RunObjects, root: Path) -> None:
    filesystem = objects.location.filesystem
    for folder in sorted(objects.dirs):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for relative, info in objects.files.items():
        target = root / relative
        with filesystem.open_input_stream(info.path) as source, target.open("wb") as out:
            while chunk := source.read(_COPY_CHUNK):
                out.write(chunk)


@contextlib.contextmanager
def local_copy(location: RunLocation) -> Iterator[Path]:
    """The run at ``location`` copied (read only from the store) into a private temporary
    directory, for the readers that work on files; the directory is removed on exit.

    One listing, then one read per object. An object that disappears between the listing and
    its read (a live run being consolidated) makes it list and copy once more.
    """
    with tempfile.TemporaryDirectory(prefix="ti-read-") as scratch:
        root = Path(scratch) / "run"
        for attempt in range(2):
            objects = list_run(location)
            try:
                _copy_all(objects, root)
                break
            except FileNotFoundError:
                shutil.rmtree(root, ignore_errors=True)
                if attempt:
                    raise
            except OSError as exc:
                raise storage_error(location, "reading the run", exc) from None
        yield root


def shown(text: str, copy: Path, uri: str) -> str:
    """``text`` with the paths of the local copy ``copy`` of a run named by its ``uri``."""
    return text.replace(str(copy), uri.rstrip("/"))


__all__ = [
    "RunObjects",
    "list_run",
    "local_copy",
    "local_path",
    "remote_location",
    "scan_objects",
    "shown",
]
