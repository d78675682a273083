"""Where a run lives: a local directory, or a prefix on an object store (S3, GCS, any pyarrow
or fsspec filesystem), and the few object operations the run needs there.

:func:`resolve_location` turns what the user gave (a path, a ``file://``, ``s3://`` or ``gs://``
URI, or a path plus a filesystem object) into a :class:`RunLocation`. A local run keeps its
``pathlib.Path`` (:attr:`RunLocation.local_path`) and every local code path stays as it was
(temporary file, fsync, ``os.replace``: :mod:`ti_io.publishing`). On an object store there is no
rename and no append, so each file a reader may open is published as one object that appears
whole (:func:`publish_bytes`, :func:`publish_with`): its complete content is built first (in
memory or in a local temporary file), handed to pyarrow in one write, and the upload is
completed only by ``close``. A small object is one PUT; a large one a multipart upload, which
S3 shows to readers only once it is completed: an upload interrupted by a kill or a failed part
is never visible (it lingers, billed, until a lifecycle rule aborts it; docs/reliability.md).

Credentials and endpoints come from the standard places (the AWS environment variables and
config files; ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` or the URI's
``?endpoint_override=`` for an S3-compatible store); nothing of the sort is stored in the run
or printed (:attr:`RunLocation.uri` drops the URI's query).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Final
from urllib.parse import parse_qs, unquote, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

_SCHEME: Final[re.Pattern[str]] = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_S3_QUERY: Final[frozenset[str]] = frozenset({"region", "endpoint_override", "scheme"})
"""URI query parameters an ``s3://`` location takes (never credentials)."""


class StorageError(OSError):
    """A run's object store cannot be reached or written: the message names the URI and what
    to check (bucket, credentials, endpoint)."""


class CredentialsInURIError(ValueError):
    """A URI holds credentials (``s3://KEY:SECRET@bucket/run``): refused, and the message never
    repeats them."""


class MissingStorageLibraryError(ImportError):
    """The library a URI's filesystem needs is not installed; the message says what to
    install."""


@dataclass(frozen=True)
class RunLocation:
    """A run directory: ``path`` inside ``filesystem``.

    ``filesystem``: a ``pyarrow.fs.FileSystem`` (``LocalFileSystem`` for a plain path).
    ``path``: the run's path inside it, ``/``-separated, no scheme (absolute for a local
    path). ``uri``: what the user gave, without its query (for messages and commands; never
    credentials).
    """

    filesystem: pafs.FileSystem
    path: str
    uri: str
    _local: Path | None = field(default=None, repr=False, compare=False)

    @property
    def local_path(self) -> Path | None:
        """The ``Path`` of a run on local disk (as the user gave it), so the existing local
        code runs unchanged; None on an object store."""
        return self._local

    @property
    def is_local(self) -> bool:
        return self._local is not None

    @property
    def name(self) -> str:
        """The last component of the path."""
        return PurePosixPath(self.path).name

    @property
    def parent(self) -> RunLocation:
        """The location one level up (the bucket itself at most)."""
        path = PurePosixPath(self.path)
        if str(path.parent) in (".", "/", ""):
            return self
        uri = self.uri.rstrip("/").rsplit("/", 1)[0]
        local = self._local.parent if self._local is not None else None
        return RunLocation(self.filesystem, str(path.parent), uri, local)

    def child(self, *names: str) -> RunLocation:
        """The location of ``names`` below this one (each one plain name or ``a/b``)."""
        for name in names:
            if (
                not name
                or name.startswith("/")
                or any(p in ("", ".", "..") for p in name.split("/"))
            ):
                raise ValueError(f"RunLocation.child: {name!r} is not a relative name")
        joined = "/".join(names)
        local = self._local.joinpath(*names) if self._local is not None else None
        return RunLocation(
            self.filesystem,
            f"{self.path.rstrip('/')}/{joined}",
            f"{self.uri.rstrip('/')}/{joined}",
            local,
        )

    def __truediv__(self, name: str) -> RunLocation:
        return self.child(name)

    def __str__(self) -> str:
        return str(self._local) if self._local is not None else self.uri


def resolve_location(
    location: str | os.PathLike[str] | RunLocation, filesystem: object | None = None
) -> RunLocation:
    """The :class:`RunLocation` of ``location``.

    ``location``: a path, a ``file://`` URI, an object-store URI (``s3://bucket/prefix/run``,
    ``gs://bucket/prefix/run``, any scheme pyarrow or an installed fsspec implementation
    knows), or a ``RunLocation`` (returned as is). ``filesystem``: a ``pyarrow.fs.FileSystem``
    or an fsspec filesystem, in which ``location`` is then a path. Resolving makes no request
    (an ``s3://`` URI with no region configured anywhere asks S3 for the bucket's region).

    Raises TypeError/ValueError for an argument of the wrong kind, MissingStorageLibraryError
    naming what to install when the URI's filesystem is not available.
    """
    if isinstance(location, RunLocation):
        if filesystem is not None:
            raise ValueError(
                "resolve_location: pass a filesystem with a path, not with a RunLocation "
                "(it has its filesystem)"
            )
        return location
    if not isinstance(location, str | os.PathLike):
        raise TypeError(
            "the run location must be a path, a URI such as 's3://bucket/prefix/run', or a "
            f"RunLocation; got {type(location).__name__}"
        )
    text = os.fspath(location)
    if not isinstance(text, str):
        raise TypeError(f"the run location must be a str path, got {type(text).__name__}")
    if not text:
        raise ValueError("the run location must not be empty; pass e.g. 'stats'")
    match = _SCHEME.match(text)
    if match is not None and match.group(1).lower() != "file":
        _refuse_credentials(text, match.group(1).lower())
    if filesystem is not None:
        return _in_filesystem(text, filesystem)
    if match is None:
        return _local(Path(location))
    scheme = match.group(1).lower()
    if scheme == "file":
        parts = urlsplit(text)
        return _local(
            Path(unquote(parts.netloc + parts.path) if parts.netloc else unquote(parts.path))
        )
    if scheme in ("s3", "s3a"):
        return _s3(text)
    return _from_uri(text, scheme)


def _refuse_credentials(uri: str, scheme: str) -> None:
    """Raise :class:`CredentialsInURIError` when ``uri`` holds a user or password before its
    host (``scheme://KEY:SECRET@bucket/...``); the message shows neither."""
    rest = uri.split("://", 1)[1]
    authority = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    if "@" not in authority:
        return
    host = authority.rsplit("@", 1)[1]
    path = _display(rest[len(authority) :]) if len(rest) > len(authority) else ""
    raise CredentialsInURIError(
        f"{scheme}://***@{host}{path}: the URI holds credentials before its host; they are "
        "refused so that they are never written into run files, logs or error messages. Give "
        "them where the storage SDK reads them (for S3: the AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY environment variables, ~/.aws/credentials or an instance role) "
        f"and pass {scheme}://{host}{path}"
    )


def _local(path: Path) -> RunLocation:
    absolute = os.path.abspath(path)
    return RunLocation(pafs.LocalFileSystem(), Path(absolute).as_posix(), str(path), path)


def _display(uri: str) -> str:
    """``uri`` without its query or fragment (where credentials could be)."""
    return uri.split("?", 1)[0].split("#", 1)[0].rstrip("/")


def _in_filesystem(path: str, filesystem: object) -> RunLocation:
    if isinstance(filesystem, pafs.LocalFileSystem):
        return _local(Path(path))
    if isinstance(filesystem, pafs.FileSystem):
        fs = filesystem
    elif _is_fsspec(filesystem):
        fs = pafs.PyFileSystem(pafs.FSSpecHandler(filesystem))
    else:
        raise TypeError(
            "filesystem= takes a pyarrow.fs.FileSystem or an fsspec filesystem, got "
            f"{type(filesystem).__name__}"
        )
    clean = path.split("://", 1)[1] if _SCHEME.match(path) else path
    clean = clean.rstrip("/") or "/"
    return RunLocation(fs, clean, f"{fs.type_name}://{clean.lstrip('/')}")


def _is_fsspec(filesystem: object) -> bool:
    try:
        from fsspec import AbstractFileSystem  # type: ignore[import-untyped]
    except ImportError:
        return False
    return isinstance(filesystem, AbstractFileSystem)


def _endpoint(query: dict[str, list[str]]) -> str | None:
    given = query.get("endpoint_override")
    if given:
        return given[0]
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        value = os.environ.get(name)
        if value:
            return value
    return None


def _s3(uri: str) -> RunLocation:
    try:
        from pyarrow.fs import S3FileSystem, resolve_s3_region
    except ImportError:
        raise MissingStorageLibraryError(
            f"{_display(uri)}: this pyarrow was built without S3 support "
            "(pyarrow.fs.S3FileSystem is missing); install pyarrow's wheel from PyPI, which "
            'has it: pip install --force-reinstall "pyarrow>=18"'
        ) from None
    parts = urlsplit(uri)
    bucket = parts.netloc
    if not bucket:
        raise ValueError(f"{uri!r} names no bucket; use s3://BUCKET/prefix/run")
    query = parse_qs(parts.query)
    unknown = sorted(set(query) - _S3_QUERY)
    if unknown:
        raise ValueError(
            f"{_display(uri)}: unknown query parameter(s) {', '.join(unknown)} (known: "
            f"{', '.join(sorted(_S3_QUERY))}); credentials come from the AWS environment "
            "variables or config files, never from the URI"
        )
    options: dict[str, Any] = {}
    if _accepts_delayed_open(S3FileSystem):
        # A small object becomes one PutObject at close instead of a three-request
        # multipart upload (large ones still upload in parts, completed at close). pyarrow
        # before 19 has no such option: every object is a multipart upload there.
        options["allow_delayed_open"] = True
    endpoint = _endpoint(query)
    if endpoint:
        scheme = query.get("scheme", [None])[0]
        if "://" in endpoint:
            scheme = scheme or endpoint.split("://", 1)[0]
        options["endpoint_override"] = endpoint
        if scheme:
            options["scheme"] = scheme
    region = (
        next(iter(query.get("region") or []), None)
        or os.environ.get("AWS_REGION")
        or os.environ.get("AWS_DEFAULT_REGION")
    )
    if region is None and not endpoint:
        with contextlib.suppress(OSError, pa.ArrowException):
            region = resolve_s3_region(bucket)  # else pyarrow's default (config file, us-east-1)
    if region:
        options["region"] = region
    key = unquote(parts.path).strip("/")
    path = f"{bucket}/{key}" if key else bucket
    return RunLocation(S3FileSystem(**options), path, _display(uri))


@functools.cache
def _accepts_delayed_open(s3: type) -> bool:
    """Whether this pyarrow's S3FileSystem takes ``allow_delayed_open`` (pyarrow >= 19)."""
    try:
        s3(allow_delayed_open=True, anonymous=True, region="us-east-1")
    except TypeError:
        return False
    except Exception:  # any other failure: the option itself was accepted
        return True
    return True


def _from_uri(uri: str, scheme: str) -> RunLocation:
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except ImportError as exc:
        raise MissingStorageLibraryError(
            f"{_display(uri)}: pyarrow's {scheme}:// filesystem is not available here ({exc}); "
            "install pyarrow's wheel from PyPI, which has it: "
            'pip install --force-reinstall "pyarrow>=18"'
        ) from None
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
        if "nrecognized" not in str(exc) and "not supported" not in str(exc).lower():
            raise ValueError(f"{_display(uri)}: {exc}") from None
        return _fsspec_uri(uri, scheme)
    if isinstance(fs, pafs.LocalFileSystem):
        return _local(Path(path))
    return RunLocation(fs, path.rstrip("/"), _display(uri))


def _fsspec_uri(uri: str, scheme: str) -> RunLocation:
    try:
        from fsspec.core import url_to_fs  # type: ignore[import-untyped]
    except ImportError:
        raise MissingStorageLibraryError(
            f"{_display(uri)}: pyarrow has no {scheme}:// filesystem; install fsspec and the "
            f'implementation of {scheme}:// (pip install "ti-io[fsspec]" and e.g. adlfs for '
            "az://), or pass filesystem= a pyarrow or fsspec filesystem"
        ) from None
    try:
        fs, path = url_to_fs(uri)
    except (ImportError, ValueError) as exc:
        raise MissingStorageLibraryError(
            f"{_display(uri)}: fsspec cannot open {scheme}:// ({exc}); install the package "
            "that implements it, or pass filesystem= a pyarrow or fsspec filesystem"
        ) from None
    located = _in_filesystem(path, fs)
    return RunLocation(located.filesystem, located.path, _display(uri))


# -- object operations (an object store; local runs use ti_io.publishing) --------------------


def _require_remote(location: RunLocation) -> None:
    if location.is_local:
        raise ValueError(f"{location} is on local disk; use ti_io.publishing for it")


def publish_bytes(location: RunLocation, data: bytes | pa.Buffer) -> None:
    """Publish ``data`` as the object at ``location``, appearing whole or not at all.

    The complete content is handed to pyarrow in one write and the upload is completed only by
    ``close``: a small object is one PUT, a large one a multipart upload that is completed
    only once every part is uploaded. A failure raises (OSError) and leaves no object, or the
    previous one, in place. Never a ``with`` block: leaving one by an exception would close,
    that is complete, the upload.
    """
    _require_remote(location)
    out = location.filesystem.open_output_stream(location.path)
    try:
        out.write(data)
    finally:
        out.close()


def publish_text(location: RunLocation, text: str) -> None:
    """Publish ``text`` (UTF-8) as one object (:func:`publish_bytes`)."""
    publish_bytes(location, text.encode("utf-8"))


@contextlib.contextmanager
def local_spool(name: str) -> Iterator[Path]:
    """A fresh local temporary file path (in the system's temporary directory, ``TMPDIR``)
    named after ``name``; removed on exit."""
    fd, tmp = tempfile.mkstemp(prefix=f".{PurePosixPath(name).name}.", suffix=".ti-tmp")
    os.close(fd)
    path = Path(tmp)
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def upload_file(location: RunLocation, local: Path) -> None:
    """Publish the local file ``local`` as one object at ``location`` (:func:`publish_bytes`;
    the file is memory-mapped, not read into memory)."""
    if local.stat().st_size == 0:
        publish_bytes(location, b"")
        return
    with pa.memory_map(str(local), "r") as source:
        publish_bytes(location, source.read_buffer())


def publish_with(location: RunLocation, write: Callable[[Path], None]) -> None:
    """Publish as one object what ``write(tmp_path)`` writes to a local temporary file."""
    _require_remote(location)
    with local_spool(location.name) as tmp:
        write(tmp)
        upload_file(location, tmp)


def read_bytes(location: RunLocation) -> bytes | None:
    """The content of the object at ``location``, or None when there is none."""
    try:
        with location.filesystem.open_input_stream(location.path) as source:
            return bytes(source.read())
    except FileNotFoundError:
        return None


def read_text(location: RunLocation) -> str | None:
    """:func:`read_bytes` decoded as UTF-8."""
    data = read_bytes(location)
    return None if data is None else data.decode("utf-8")


def exists(location: RunLocation) -> bool:
    """Whether an object (a file) is at ``location``."""
    info = location.filesystem.get_file_info(location.path)
    return bool(info.type == pafs.FileType.File)


def list_files(location: RunLocation, *, recursive: bool = False) -> list[pafs.FileInfo]:
    """The files (objects) below ``location``, sorted by path; empty when there are none.
    One list request per 1,000 objects (S3); directory markers are left out."""
    selector = pafs.FileSelector(location.path, recursive=recursive, allow_not_found=True)
    try:
        infos = location.filesystem.get_file_info(selector)
    except FileNotFoundError:
        return []
    return sorted(
        (info for info in infos if info.type == pafs.FileType.File), key=lambda info: info.path
    )


def list_names(location: RunLocation) -> list[str]:
    """The names of the files and prefixes directly below ``location`` (one listing)."""
    selector = pafs.FileSelector(location.path, recursive=False, allow_not_found=True)
    try:
        infos = location.filesystem.get_file_info(selector)
    except FileNotFoundError:
        return []
    return sorted(PurePosixPath(info.path).name for info in infos)


def delete_files(filesystem: pafs.FileSystem, paths: Iterable[str]) -> int:
    """Delete the objects at ``paths`` (each one DELETE; a missing one is skipped); returns how
    many were deleted."""
    deleted = 0
    for path in paths:
        try:
            filesystem.delete_file(path)
        except FileNotFoundError:
            continue
        deleted += 1
    return deleted


def download(location: RunLocation, local: Path) -> None:
    """Copy the object at ``location`` to the local file ``local`` (streamed)."""
    with location.filesystem.open_input_stream(location.path) as source, open(local, "wb") as out:
        while True:
            chunk = source.read(8 << 20)
            if not chunk:
                break
            out.write(chunk)


_HINTS: Final[tuple[tuple[tuple[str, ...], str], ...]] = (
    (
        ("NO_SUCH_BUCKET", "NoSuchBucket", "bucket does not exist"),
        "the bucket does not exist: create it, or check the bucket name in the URI",
    ),
    (
        (
            "ACCESS_DENIED",
            "AccessDenied",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "INVALID_ACCESS_KEY_ID",
            "SIGNATURE_DOES_NOT_MATCH",
            "Forbidden",
        ),
        "the credentials were refused: check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
        "AWS_PROFILE or the config files, and that they may list, read, write and delete "
        "objects under this prefix",
    ),
    (
        (
            "connect",
            "Connection refused",
            "NETWORK_CONNECTION",
            "curlCode",
            "Couldn't resolve",
            "Timeout",
            "timed out",
        ),
        "the endpoint cannot be reached: check AWS_ENDPOINT_URL (or the URI's "
        "endpoint_override) and the network",
    ),
)


def storage_error(location: RunLocation, doing: str, cause: BaseException) -> StorageError:
    """One clear error for an object-store operation that failed: the URI, what was being
    done, the cause, and what to check."""
    text = str(cause)
    hint = next(
        (h for needles, h in _HINTS if any(n.lower() in text.lower() for n in needles)),
        "check the bucket, the credentials (AWS environment variables or config files) "
        "and the endpoint (AWS_ENDPOINT_URL)",
    )
    first = text.strip().splitlines()[0] if text.strip() else type(cause).__name__
    return StorageError(f"{location.uri}: {doing} failed: {hint}. ({first})")


__all__ = [
    "CredentialsInURIError",
    "MissingStorageLibraryError",
    "RunLocation",
    "StorageError",
    "delete_files",
    "download",
    "exists",
    "list_files",
    "list_names",
    "local_spool",
    "publish_bytes",
    "publish_text",
    "publish_with",
    "read_bytes",
    "read_text",
    "resolve_location",
    "storage_error",
    "upload_file",
]
