"""Run directories written by torchinstruments 0.8.0: ``upgrade``, and reading what it wrote.

A 0.8.0 run holds ``history.parquet`` (or, interrupted, ``history.parts/NNNNNNNN.parquet``)
with the twelve columns of ``LEGACY_COLUMNS`` and no ``ti`` footer, a ``result.json`` whose
records are its layer catalog (``layer``, ``type``, ``aliases``), an ``index.md`` stating the
sampler, rank and window, and ``tensorboard/``. Recognizing one is
:mod:`ti_io.read.legacy_layout` (every ``ti`` command asks it first).

:func:`upgrade` converts one into the current contract in a new directory: the history
streamed file by file with its columns mapped and tensor paths respelled (``output`` -> ``''``,
``output.0`` -> ``[0]``, ``grad_output.aux.0`` -> ``['aux'][0]``), result.json and index.md
built as finalization builds them, ``tensorboard/`` copied as it is. What 0.8.0 never recorded
is marked in the ``ti`` footer (``upgraded_from``, ``unrecorded``; contract 1.1) and holds the
contract's placeholders (``ti_schema.PLACEHOLDERS``). Nothing is written unless the whole
conversion succeeds: it is built in a temporary directory beside the destination, then renamed.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ti_io.facts import CatalogLayer, RunFacts
from ti_io.finish.consolidate import FINAL_COMPRESSION, ROW_GROUP_ROWS
from ti_io.finish.digest import HistoryDigest
from ti_io.finish.events import write_events_table
from ti_io.finish.index_md import render as render_index
from ti_io.finish.result_json import render
from ti_io.integrity import open_verified, parquet_write_options, read_error
from ti_io.progress import ProgressCallback
from ti_io.publishing import fsync_dir, publish_text, temp_path
from ti_io.read.legacy_layout import (
    LEGACY_COLUMNS,
    history_files,
    legacy_run_reason,
    rank_dirs,
)
from ti_schema import DEFAULT_METRICS, METADATA_KEY, PLACEHOLDERS, empty_events, history_schema
from ti_schema.layout import (
    EVENTS_FILE,
    HISTORY_FILE,
    HISTORY_PARTS,
    INDEX_FILE,
    RESULT_FILE,
    TENSORBOARD_DIR,
    rank_of_dir,
)
from ti_schema.legacy_paths import modern_path

if TYPE_CHECKING:
    from ti_io.storage import RunLocation

LEGACY_PRODUCER: Final[str] = "torchinstruments 0.8.0"
LEGACY_WINDOW: Final[int] = 20
"""0.8.0's default ``HistoryConfig.window``, used when its index.md does not state one."""
NO_REASON: Final[str] = "unavailable (torchinstruments 0.8.0 recorded no reason)"
NONFINITE_REASON: Final[str] = "non-finite value in the torchinstruments 0.8.0 history"

_WINDOW: Final[re.Pattern[str]] = re.compile(r"recent window contains at most (\d+) observations")
_COLLECTION: Final[re.Pattern[str]] = re.compile(
    r"^Sampling: (.+?)\. Rank: (\d+)/(\d+)\.$", re.MULTILINE
)
_FOCUS: Final[re.Pattern[str]] = re.compile(r"^Histogram layers: (\(.*\))\.$", re.MULTILINE)


class UpgradeError(ValueError):
    """``upgrade`` cannot convert the directory it was given; nothing was written."""


@dataclass(frozen=True)
class UpgradedRun:
    """One converted run (a directory, or one ``rank-NNN`` of it)."""

    source: Path
    destination: Path | str
    """Where it was written (a URI for a run written to object storage)."""
    history_rows: int
    rank: int
    interrupted: bool
    """The 0.8.0 run was never finalized: its history came from ``history.parts/``."""
    unrecorded: tuple[str, ...]


@dataclass(frozen=True)
class Upgraded:
    """What :func:`upgrade` wrote."""

    directory: Path | str
    """The upgraded run (a URI on object storage)."""
    runs: tuple[UpgradedRun, ...]


# ---------------------------------------------------------------------------- upgraded runs


def upgraded_from(directory: Path) -> tuple[str, tuple[str, ...]] | None:
    """``(upgraded_from, unrecorded)`` from the ``ti`` footer of a finalized run converted by
    :func:`upgrade`, or None."""
    from ti_schema import parse_metadata

    try:
        doc = parse_metadata(pq.read_metadata(directory / HISTORY_FILE).metadata)
    except (OSError, ValueError):
        return None
    source = doc.get("upgraded_from")
    if not isinstance(source, str):
        return None
    unrecorded = doc.get("unrecorded")
    names = (
        tuple(c for c in unrecorded if isinstance(c, str)) if isinstance(unrecorded, list) else ()
    )
    return source, names


# --------------------------------------------------------------------------------- converting


@dataclass(frozen=True)
class _OldFacts:
    catalog: tuple[CatalogLayer, ...]
    window: int
    sampler: str | None
    rank: int | None
    world_size: int | None
    focus: tuple[str, ...]


def _read_old_facts(directory: Path) -> _OldFacts:
    import json

    catalog: list[CatalogLayer] = []
    try:
        records = json.loads((directory / RESULT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        records = []
    for record in records if isinstance(records, list) else []:
        if not isinstance(record, dict) or not isinstance(record.get("layer"), str):
            continue
        name = record["layer"]
        kind = record.get("type")
        aliases = record.get("aliases")
        catalog.append(
            CatalogLayer(
                name=name,
                # 0.8.0 wrote __qualname__ (e.g. "Outer.Block"); the contract has the class name
                module_type=kind.rsplit(".", 1)[-1] if isinstance(kind, str) else "",
                aliases=tuple(
                    a for a in (aliases if isinstance(aliases, list) else []) if a != name
                ),
            )
        )
    try:
        index = (directory / INDEX_FILE).read_text(encoding="utf-8")
    except OSError:
        index = ""
    window = _WINDOW.search(index)
    collection = _COLLECTION.search(index)
    focus: tuple[str, ...] = ()
    focus_match = _FOCUS.search(index)
    if focus_match is not None:
        with contextlib.suppress(ValueError, SyntaxError):
            parsed = ast.literal_eval(focus_match.group(1))
            if isinstance(parsed, tuple) and all(isinstance(n, str) for n in parsed):
                focus = parsed
    return _OldFacts(
        catalog=tuple(catalog),
        window=int(window.group(1)) if window and int(window.group(1)) > 0 else LEGACY_WINDOW,
        sampler=collection.group(1) if collection else None,
        rank=int(collection.group(2)) if collection else None,
        world_size=int(collection.group(3)) if collection else None,
        focus=focus,
    )


def _ti_io_producer() -> str:
    try:
        return f"ti-io {metadata.version('ti-io')}"
    except metadata.PackageNotFoundError:  # pragma: no cover - source tree without install
        return "ti-io unknown"


def _run_id(files: list[Path]) -> str:
    """One id per converted run, the same each time the same 0.8.0 files are upgraded."""
    digest = hashlib.sha256()
    for path in files:
        with path.open("rb") as source:
            for block in iter(lambda: source.read(1 << 20), b""):
                digest.update(block)
    return f"torchinstruments-0.8.0-{digest.hexdigest()[:24]}"


def _read_tables(files: list[Path], columns: list[str] | None = None) -> Iterator[pa.Table]:
    for path in files:
        try:
            source = open_verified(path)
        except Exception as exc:
            raise UpgradeError(
                f"upgrade: cannot read {path} as Parquet ({exc}); nothing was written"
            ) from exc
        with source:
            if sorted(source.schema_arrow.names) != sorted(LEGACY_COLUMNS):
                raise UpgradeError(
                    f"upgrade: {path} does not have torchinstruments 0.8.0's columns "
                    f"({', '.join(LEGACY_COLUMNS)}); nothing was written"
                )
            for group in range(source.num_row_groups):
                try:
                    table = source.read_row_group(group, columns=columns)
                except (OSError, pa.ArrowException) as exc:
                    raise UpgradeError(
                        f"upgrade: {read_error(path, exc)}; nothing was written"
                    ) from None
                if table.num_rows:
                    yield table


def _convert(
    table: pa.Table,
    schema: pa.Schema,
    *,
    run_id: str,
    rank: int,
    types: dict[str, str],
) -> pa.Table:
    """One 0.8.0 history table as ``ti.history`` rows (same order)."""
    n = table.num_rows
    layer = table.column("layer").cast(pa.string())
    paths = table.column("tensor_path").cast(pa.string())
    spelled = {p: modern_path(p) for p in pc.unique(paths).to_pylist() if p is not None}
    value = table.column("value").cast(pa.float64())
    finite = pc.is_finite(value)
    kept = pc.if_else(finite, value, pa.scalar(None, pa.float64()))
    reason = table.column("unavailable_reason").cast(pa.string())
    reason = pc.if_else(
        pc.equal(pc.fill_null(reason, ""), ""), pa.scalar(None, pa.string()), reason
    )
    reason = pc.if_else(
        pc.is_null(kept),
        pc.if_else(pc.is_valid(value), NONFINITE_REASON, pc.fill_null(reason, NO_REASON)),
        pa.scalar(None, pa.string()),
    )
    columns: dict[str, Any] = {
        "run_id": pa.array([run_id] * n, pa.string()),
        "rank": pa.array([rank] * n, pa.int32()),
        "sample_id": table.column("sample_id"),
        "forward_index": table.column("forward_index"),
        "timestamp": table.column("timestamp"),
        "layer": layer,
        "module_type": pa.array([types.get(x, "") for x in layer.to_pylist()], pa.string()),
        "call_index": table.column("call_index"),
        "signal": table.column("signal"),
        "tensor_path": pa.array([spelled.get(p, p) for p in paths.to_pylist()], pa.string()),
        "mode": pa.array([PLACEHOLDERS["mode"]] * n, pa.string()),
        "grad_enabled": pa.array([PLACEHOLDERS["grad_enabled"]] * n, pa.bool_()),
        "shape": table.column("shape"),
        "dtype": table.column("dtype"),
        "metric": table.column("metric"),
        "value": kept,
        "unavailable_reason": reason,
    }
    return pa.table([columns[f.name] for f in schema], names=schema.names).cast(schema)


def _upgrade_run(
    source: Path,
    build: Path,
    final: Path,
    rank_hint: int | None,
    on_rows: Callable[[int], None] = lambda rows: None,
) -> UpgradedRun:
    """Convert the 0.8.0 run in ``source`` into ``build`` (a temporary directory that becomes
    ``final``, the path index.md names); ``on_rows(n)`` after each ``n`` rows converted."""
    files, interrupted = history_files(source)
    old = _read_old_facts(source)
    rank = old.rank if old.rank is not None else rank_hint
    types = {layer.name: layer.module_type for layer in old.catalog if layer.module_type}
    history_layers: set[str] = set()
    for table in _read_tables(files, ["layer"]):  # a first pass: are all module types known?
        history_layers |= set(pc.unique(table.column("layer")).to_pylist())
    unrecorded = ["run_id", "mode", "grad_enabled"]
    if rank is None:
        unrecorded.append("rank")
    if any(name not in types for name in history_layers):
        unrecorded.append("module_type")
    rank_value = rank if rank is not None else cast(int, PLACEHOLDERS["rank"])
    producer = _ti_io_producer()
    schema = history_schema(
        producer, window=old.window, upgraded_from=LEGACY_PRODUCER, unrecorded=unrecorded
    )
    run_id = _run_id(files)
    with HistoryDigest(sum(pq.read_metadata(f).num_rows for f in files)) as digest:
        rows = 0
        seen_metrics: set[str] = set()
        build.mkdir(parents=True)
        with pq.ParquetWriter(
            build / HISTORY_FILE, schema, **parquet_write_options(FINAL_COMPRESSION)
        ) as writer:
            for table in _read_tables(files):
                converted = _convert(table, schema, run_id=run_id, rank=rank_value, types=types)
                writer.write_table(converted, row_group_size=ROW_GROUP_ROWS)
                digest.add(converted)
                seen_metrics |= set(pc.unique(converted.column("metric")).to_pylist())
                rows += converted.num_rows
                on_rows(converted.num_rows)
        # torchinstruments 0.8.0 recorded no events: the table of the current contract, empty.
        write_events_table(build / EVENTS_FILE, empty_events(producer), FINAL_COMPRESSION)
        metrics = [m for m in DEFAULT_METRICS if m in seen_metrics or not seen_metrics]
        metrics += sorted(seen_metrics - set(metrics))
        facts = RunFacts(
            run_id=run_id,
            rank=rank_value,
            world_size=old.world_size,
            producer=f"{producer} (upgrade of a {LEGACY_PRODUCER} run)",
            started_at=None,
            layers=old.catalog,
            focus_layers=old.focus,
            metrics=tuple(metrics),
            sampler=f"{old.sampler} (torchinstruments 0.8.0)" if old.sampler else None,
            window=old.window,
            settings={
                "upgraded_from": LEGACY_PRODUCER,
                "unrecorded": ", ".join(unrecorded),
                "interrupted": str(interrupted).lower(),
            },
        )
        aggregated = digest.aggregated(old.window, build / HISTORY_FILE)
        text = render(old.catalog, aggregated, window=old.window, metrics=metrics)
        publish_text(build / RESULT_FILE, text)
        index = render_index(final.resolve(), facts, digest.facts(None), live=False, events=[])
        publish_text(build / INDEX_FILE, index)
        if (source / TENSORBOARD_DIR).is_dir():
            shutil.copytree(source / TENSORBOARD_DIR, build / TENSORBOARD_DIR)
        return UpgradedRun(
            source=source,
            destination=final,
            history_rows=rows,
            rank=rank_value,
            interrupted=interrupted,
            unrecorded=tuple(unrecorded),
        )


def _history_rows(runs: list[tuple[Path, Path, int | None]]) -> int:
    """The history rows of every run to upgrade, from the Parquet footers (the total of the
    progress reports)."""
    total = 0
    for source, _, _ in runs:
        for path in history_files(source)[0]:
            with contextlib.suppress(Exception):  # unreadable: _read_tables says so
                total += pq.read_metadata(path).num_rows
    return total


def _publish_order(relative: Path) -> tuple[int, str]:
    # Each run's history.parquet last: a reader takes a run with it as finished.
    return (1 if relative.name == HISTORY_FILE else 0, relative.as_posix())


def _upgrade_to_store(
    old_dir: str | os.PathLike[str], target: RunLocation, progress: ProgressCallback | None
) -> Upgraded:
    """:func:`upgrade` into an empty prefix of an object store: converted in a local
    temporary directory, then each file published as one object that appears whole."""
    import tempfile

    from ti_io.storage import list_files, storage_error, upload_file

    try:
        occupied = list_files(target, recursive=True)
    except OSError as exc:
        raise storage_error(target, "listing the upgrade destination", exc) from None
    if occupied:
        raise UpgradeError(f"upgrade: {target.uri} already holds objects; choose a new prefix")
    with tempfile.TemporaryDirectory(prefix="ti-upgrade-") as scratch:
        staged = Path(scratch) / "run"
        done = upgrade(old_dir, staged, progress=progress)
        files = sorted(
            (p.relative_to(staged) for p in staged.rglob("*") if p.is_file()), key=_publish_order
        )
        for relative in files:
            where = target.child(relative.as_posix())
            try:
                upload_file(where, staged / relative)
            except OSError as exc:
                raise storage_error(where, "publishing the upgraded run", exc) from None
        runs = tuple(
            dataclasses.replace(
                run,
                destination=target.uri
                if run.destination == staged
                else target.child(Path(run.destination).relative_to(staged).as_posix()).uri,
            )
            for run in done.runs
        )
    return Upgraded(target.uri, runs)


def upgrade(
    old_dir: str | os.PathLike[str],
    new_dir: str | os.PathLike[str] | RunLocation,
    *,
    progress: ProgressCallback | None = None,
) -> Upgraded:
    """Convert the torchinstruments 0.8.0 run in ``old_dir`` into a run of the current contract
    in ``new_dir`` (which must not exist yet, or be empty); ``old_dir`` is only read.

    A directory of 0.8.0 ``rank-NNN`` runs becomes the same ``rank-NNN`` layout. The result
    passes ``ti validate`` and reads with the same queries as a new run. Raises
    :class:`UpgradeError` (and writes nothing) for a missing, foreign or already current
    directory, or an occupied ``new_dir``. ``progress(done, total)`` counts history rows
    converted (the ``ti`` command draws it).

    ``new_dir`` may be a prefix on object storage (``s3://bucket/run``, a
    ``ti_io.RunLocation``), which must hold no object yet: the run is converted in a local
    temporary directory and each file published as one object (each run's
    ``history.parquet`` last); ``old_dir`` on object storage is read by ``ti upgrade`` from
    a local copy.
    """
    from ti_io.read.remote import local_path, remote_location

    remote = remote_location(new_dir)
    if remote is not None:
        return _upgrade_to_store(old_dir, remote, progress)
    source, target = Path(old_dir), local_path(new_dir)
    if not source.is_dir():
        raise UpgradeError(f"upgrade: {source} is not a directory; pass a 0.8.0 run directory")
    runs: list[tuple[Path, Path, int | None]]
    if legacy_run_reason(source) is not None:
        runs = [(source, target, rank_of_dir(source.name))]
    else:
        ranks = [r for r in rank_dirs(source) if legacy_run_reason(r) is not None]
        if not ranks:
            raise UpgradeError(_not_legacy_message(source))
        runs = [(r, target / r.name, rank_of_dir(r.name)) for r in ranks]
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UpgradeError(
            f"upgrade: {target} already exists and is not empty; choose a new directory"
        )
    if target.resolve() == source.resolve() or source.resolve() in target.resolve().parents:
        raise UpgradeError(
            f"upgrade: {target} is inside {source}; write the upgraded run somewhere else"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    building = temp_path(target)
    done: list[UpgradedRun] = []
    total = _history_rows(runs) if progress is not None else 0
    converted = 0

    def on_rows(rows: int) -> None:
        nonlocal converted
        converted += rows
        if progress is not None:
            progress(converted, max(total, converted))

    try:
        for run_source, run_target, rank in runs:
            place = building / run_target.relative_to(target)
            done.append(_upgrade_run(run_source, place, run_target, rank, on_rows))
        if target.exists():
            target.rmdir()  # empty, checked above
        os.replace(building, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return Upgraded(target, tuple(done))


def _not_legacy_message(directory: Path) -> str:
    final = directory / HISTORY_FILE
    with contextlib.suppress(Exception):
        if METADATA_KEY in (pq.read_metadata(final).metadata or {}):
            return (
                f"upgrade: {directory} is already a run of the current contract (its "
                f"{HISTORY_FILE} has a 'ti' footer); nothing to upgrade"
            )
    if (directory / HISTORY_PARTS).is_dir() and any(
        p.name.startswith("part-") for p in (directory / HISTORY_PARTS).iterdir()
    ):
        return (
            f"upgrade: {directory} is an unfinished run of the current contract; finish it with "
            f"`ti consolidate {directory}`, there is nothing to upgrade"
        )
    return (
        f"upgrade: {directory} holds no torchinstruments 0.8.0 run: no {HISTORY_FILE} or "
        f"{HISTORY_PARTS}/ with 0.8.0's columns ({', '.join(LEGACY_COLUMNS)}) and no 'ti' footer"
    )
