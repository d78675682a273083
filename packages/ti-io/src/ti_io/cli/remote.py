"""Reading commands on runs that live on object storage (``ti summary s3://bucket/run``).

A command that reads files opts in with ``set_defaults(remote_reads=(ARGUMENT, ...))``: each of
those arguments that names a run on object storage (a URI such as ``s3://bucket/run``) is
replaced, for the command's run, by a read-only local copy of the run
(:func:`ti_io.read.remote.local_copy`: one listing, one read per object, nothing written to
the store), and everything the command prints names the URI again instead of the copy. The
copies are removed when the command ends. Commands that write to the store (``ti
consolidate``) do not opt in: they work on the store itself.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO


def is_uri(text: str) -> bool:
    """Whether a path argument is a URI (``s3://...``, ``file://...``) rather than a path."""
    return "://" in text


class _Renaming:
    """A text stream writing to ``stream`` with each local copy's path replaced by its URI."""

    def __init__(self, stream: TextIO, names: dict[str, str]) -> None:
        self._stream = stream
        self._names = names

    def write(self, text: str) -> int:
        return self._stream.write(_renamed(text, self._names))

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, buffer, encoding...
        return getattr(self._stream, name)


@contextlib.contextmanager
def remote_reads(args: argparse.Namespace) -> Iterator[None]:
    """Replace the URI arguments of ``args.remote_reads`` by local copies for the block (see
    the module); stdout and stderr, and the message of an error raised, name the URIs. Nothing
    happens (nothing is imported) for local paths."""
    names: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        for name in getattr(args, "remote_reads", ()):
            value = getattr(args, name)
            values = value if isinstance(value, list) else [value]
            replaced = []
            for item in values:
                if not (isinstance(item, str) and is_uri(item)):
                    replaced.append(item)
                    continue
                from ti_io.read.remote import local_copy, remote_location

                location = remote_location(item)
                if location is None:  # file://
                    replaced.append(item)
                    continue
                copy: Path = stack.enter_context(local_copy(location))
                names[str(copy)] = location.uri.rstrip("/")
                replaced.append(str(copy))
            setattr(args, name, replaced if isinstance(value, list) else replaced[0])
        if not names:
            yield
            return
        out, err = sys.stdout, sys.stderr
        sys.stdout = _Renaming(out, names)
        sys.stderr = _Renaming(err, names)
        try:
            yield
        except Exception as exc:
            _rename_error(exc, names)
            raise
        finally:
            sys.stdout, sys.stderr = out, err


def _renamed(text: str, names: dict[str, str]) -> str:
    for copy, uri in names.items():
        text = text.replace(copy, uri)
    return text


def _rename_error(exc: BaseException, names: dict[str, str]) -> None:
    """Name the URIs in ``exc``'s message (``ti``'s one line is ``str(exc)``)."""
    exc.args = tuple(_renamed(a, names) if isinstance(a, str) else a for a in exc.args)
    if isinstance(exc, OSError) and isinstance(exc.filename, str):
        exc.filename = _renamed(exc.filename, names)


__all__ = ["is_uri", "remote_reads"]
