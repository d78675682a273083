"""A real S3-protocol server on loopback for the object-storage tests: moto in server mode.

Independent of ti_io, so that packages/ti-io/tests (its conftest imports the fixtures) and the
top-level tests/ (loading this file by path, as they load tests/run_damage.py, and importing
its fixtures into the test module) use the same server. One server per test session (the
``moto`` fixture); each test gets its own bucket (the ``s3`` fixture, an ``S3Store``) and the
AWS environment variables pointing at the server, so code resolving ``s3://`` URIs the
standard way reaches it, child processes included. Nothing leaves 127.0.0.1: the credentials
are moto's dummies, the config files point at nothing, the instance-metadata lookup is off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"


def free_port() -> int:
    """A loopback port nothing listens on (bound and released: the OS does not hand it out
    again at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def aws_environment(endpoint: str) -> dict[str, str]:
    """The environment variables that send the standard AWS credential and endpoint lookup
    (pyarrow, Polars' object_store, boto) to ``endpoint`` and nowhere else."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }


@dataclass(frozen=True)
class MotoServer:
    """A running moto server: its ``endpoint`` (``http://127.0.0.1:PORT``) and every request
    it received (``requests``)."""

    endpoint: str
    log: _RequestLog

    def requests(self, bucket: str | None = None) -> list[Request]:
        """The requests received so far (those of ``bucket`` only, when given), in order."""
        seen = self.log.snapshot()
        return seen if bucket is None else [r for r in seen if r.bucket == bucket]

    def filesystem(self, **options: Any) -> pafs.S3FileSystem:
        """A pyarrow S3 filesystem on this server (the endpoint passed explicitly: pyarrow's
        constructor does not read AWS_ENDPOINT_URL; its ``from_uri`` does)."""
        return pafs.S3FileSystem(
            access_key=ACCESS_KEY,
            secret_key=SECRET_KEY,
            region=REGION,
            endpoint_override=self.endpoint,
            scheme="http",
            **options,
        )

    def create_bucket(self, name: str | None = None) -> str:
        """A new, empty bucket (a fresh name unless given); returns its name."""
        bucket = name or f"ti-{uuid.uuid4().hex[:12]}"
        self.filesystem(allow_bucket_creation=True).create_dir(bucket)
        return bucket


@dataclass(frozen=True)
class S3Store:
    """One test's bucket on the server: ``uri(...)`` names a prefix in it, ``filesystem`` reads
    and writes it directly, ``environment`` is what the test process (and any child it starts)
    has set."""

    server: MotoServer
    bucket: str
    filesystem: pafs.S3FileSystem
    environment: Mapping[str, str]

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def uri(self, *parts: str) -> str:
        """``s3://BUCKET/part/part``."""
        return "/".join([f"s3://{self.bucket}", *parts])

    def key(self, *parts: str) -> str:
        """The same location as ``uri`` in pyarrow's form (``BUCKET/part/part``)."""
        return "/".join([self.bucket, *parts])

    def requests(self) -> list[Request]:
        """Every request this bucket received so far (its creation included), in order."""
        return self.server.requests(self.bucket)

    def outage(self, code: str = "ServiceUnavailable") -> contextlib.AbstractContextManager[None]:
        """For the block, every write to this bucket is refused with the S3 error ``code``
        (``"ServiceUnavailable"``: 503, retried by clients; ``"AccessDenied"``: 403, as for
        revoked credentials); reads are served, the objects kept."""
        return self.server.log.outage(self.bucket, code)

    def polars_options(self) -> dict[str, str]:
        """``storage_options`` for Polars (object_store's keys) reaching this server."""
        return {
            "aws_endpoint_url": self.endpoint,
            "aws_allow_http": "true",
            "aws_access_key_id": ACCESS_KEY,
            "aws_secret_access_key": SECRET_KEY,
            "aws_region": REGION,
        }

    def upload(self, local: Path, *parts: str) -> str:
        """Every file under the local folder ``local`` as one object (one PUT each) under
        ``parts``, as a run written there would hold it; returns that prefix's URI."""
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            key = self.key(*parts, *path.relative_to(local).parts)
            with self.filesystem.open_output_stream(key) as out:
                out.write(path.read_bytes())
        return self.uri(*parts)

    def keys(self, *parts: str) -> list[str]:
        """Every object under ``parts`` (relative to the bucket), sorted."""
        selector = pafs.FileSelector(self.key(*parts), recursive=True, allow_not_found=True)
        infos = self.filesystem.get_file_info(selector)
        prefix = f"{self.bucket}/"
        return sorted(
            info.path.removeprefix(prefix) for info in infos if info.type == pafs.FileType.File
        )


@dataclass(frozen=True)
class Request:
    """One HTTP request the server received."""

    method: str
    path: str
    """Path-style: ``/BUCKET/KEY`` (pyarrow and Polars use path-style with an endpoint)."""
    query: str

    @property
    def bucket(self) -> str:
        return self.path.lstrip("/").split("/", 1)[0]

    @property
    def is_list(self) -> bool:
        """A listing (ListObjects / ListObjectsV2: a GET of the bucket itself)."""
        return self.method == "GET" and "/" not in self.path.strip("/")

    @property
    def is_write(self) -> bool:
        """A request that changes the store (PUT, POST: multipart steps, DELETE)."""
        return self.method in ("PUT", "POST", "DELETE")


_REFUSALS: dict[str, tuple[str, str]] = {
    # code: (HTTP status, message), as S3 answers them
    "ServiceUnavailable": ("503 Service Unavailable", "Service is unable to handle request."),
    "AccessDenied": ("403 Forbidden", "Access Denied"),
}


class _RequestLog:
    """WSGI middleware recording every request before moto answers it; during an
    :meth:`outage` of a bucket it refuses that bucket's writes with an S3 error (503
    ServiceUnavailable, which clients retry, or 403 AccessDenied: revoked credentials), reads
    still served."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._lock = threading.Lock()
        self.requests: list[Request] = []
        self.refused: list[Request] = []
        self._down: dict[str, str] = {}

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        request = Request(
            environ.get("REQUEST_METHOD", ""),
            environ.get("PATH_INFO", ""),
            environ.get("QUERY_STRING", ""),
        )
        with self._lock:
            self.requests.append(request)
            code = self._down.get(request.bucket) if request.is_write else None
            if code is not None:
                self.refused.append(request)
        if code is None:
            return self._app(environ, start_response)
        environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        status, message = _REFUSALS[code]
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"
        ).encode()
        headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))]
        start_response(status, headers)
        return [body]

    @contextlib.contextmanager
    def outage(self, bucket: str, code: str = "ServiceUnavailable") -> Iterator[None]:
        """Every write to ``bucket`` refused with ``code`` for the block; what it holds is
        kept."""
        if code not in _REFUSALS:
            raise ValueError(f"outage(code=...) is one of {sorted(_REFUSALS)}, got {code!r}")
        with self._lock:
            self._down[bucket] = code
        try:
            yield
        finally:
            with self._lock:
                self._down.pop(bucket, None)

    def snapshot(self) -> list[Request]:
        with self._lock:
            return list(self.requests)


@contextlib.contextmanager
def moto_server() -> Iterator[MotoServer]:
    """Start moto's S3 server (its WSGI application, served as its ThreadedMotoServer does,
    with every request recorded) on a free loopback port; stop it on exit."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    log = _RequestLog(DomainDispatcherApplication(create_backend_app))
    server = make_server(
        "127.0.0.1", free_port(), log, threaded=True, request_handler=MotoRequestHandler
    )
    thread = threading.Thread(target=server.serve_forever, name="moto-s3", daemon=True)
    thread.start()
    try:
        yield MotoServer(endpoint=f"http://127.0.0.1:{server.server_port}", log=log)
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()


def _uploading_filesystem(server: MotoServer) -> pafs.S3FileSystem:
    """A filesystem on ``server`` that uploads a small object in one PUT (pyarrow >= 19's
    ``allow_delayed_open``; pyarrow 18, the floor, uploads in three requests)."""
    try:
        return server.filesystem(allow_delayed_open=True)
    except TypeError:
        return server.filesystem()


def new_store(server: MotoServer) -> S3Store:
    """A fresh bucket on ``server`` with the environment that reaches it (not yet applied)."""
    bucket = server.create_bucket()
    return S3Store(
        server=server,
        bucket=bucket,
        filesystem=_uploading_filesystem(server),
        environment=aws_environment(server.endpoint),
    )


@contextlib.contextmanager
def applied_environment(environment: Mapping[str, str]) -> Iterator[None]:
    """``environment`` set in ``os.environ`` for the block, the previous values restored after
    (for callers without pytest's monkeypatch)."""
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def moto() -> Iterator[MotoServer]:
    """One moto server for the test session."""
    with moto_server() as server:
        yield server


@pytest.fixture
def s3(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> S3Store:
    """A fresh bucket, and the AWS environment variables pointing at the server for the test."""
    store = new_store(moto)
    for name, value in store.environment.items():
        monkeypatch.setenv(name, value)
    return store
