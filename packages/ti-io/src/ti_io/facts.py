"""Run facts the artifacts describe, and where they live between open and consolidation.

At ``open`` the sink writes ``history.parts/run.json`` (everything in ``RunInfo`` but the layer
catalog, plus the window length and the writing process) so that ``consolidate`` can finish a
crashed run with the same settings; the sink rewrites it with each telemetry cost figure the
observer hands it (``telemetry_cost``: at removal, before a flush, at most once a minute), so a
crashed run keeps its latest one. The catalog itself is result.json, written at open too. Once
finalized, the window and the telemetry cost are run facts of the ``ti`` footer of
``history.parquet`` (contract 1.1 / 1.4).
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Final, Protocol

from ti_io.damaged import SkippedPart, read_skipped
from ti_io.publishing import publish_text
from ti_io.storage import RunLocation
from ti_schema.cost import RunCost
from ti_schema.layout import HISTORY_FILE, HISTORY_PARTS, INDEX_FILE, RESULT_FILE, RUN_FILE
from ti_schema.sink import RunInfo


class LayerLike(Protocol):
    """A catalog entry: ``ti_schema.LayerInfo`` or :class:`CatalogLayer`."""

    @property
    def name(self) -> str: ...
    @property
    def module_type(self) -> str: ...
    @property
    def aliases(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class CatalogLayer:
    """A layer of the catalog as read back from result.json."""

    name: str
    module_type: str
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunFacts:
    """What index.md and result.json need to know about a run beyond its rows."""

    run_id: str | None
    rank: int | None
    world_size: int | None
    producer: str | None
    started_at: str | None
    layers: tuple[LayerLike, ...]
    focus_layers: tuple[str, ...]
    metrics: tuple[str, ...]
    sampler: str | None
    window: int
    settings: Mapping[str, str] = field(default_factory=dict)
    pid: int | None = None
    host: str | None = None
    skipped: tuple[SkippedPart, ...] = ()
    """Damaged parts a consolidation left out (``damaged/skipped.json``): the history has a
    gap where they were."""
    telemetry_cost: RunCost | None = None
    """The run's measured telemetry cost, its latest figure (None: never reported)."""

    @classmethod
    def from_run(cls, run: RunInfo, window: int) -> RunFacts:
        return cls(
            run_id=run.run_id,
            rank=run.rank,
            world_size=run.world_size,
            producer=run.producer,
            started_at=run.started_at.isoformat(),
            layers=tuple(run.layers),
            focus_layers=tuple(run.focus_layers),
            metrics=tuple(run.metrics),
            sampler=run.sampler,
            window=window,
            settings={str(k): str(v) for k, v in run.settings.items()},
            pid=os.getpid(),
            host=socket.gethostname(),
        )

    def to_json(self) -> str:
        doc = {
            "run_id": self.run_id,
            "rank": self.rank,
            "world_size": self.world_size,
            "producer": self.producer,
            "started_at": self.started_at,
            "focus_layers": list(self.focus_layers),
            "metrics": list(self.metrics),
            "sampler": self.sampler,
            "window": self.window,
            "settings": dict(self.settings),
            "pid": self.pid,
            "host": self.host,
            "telemetry_cost": self.telemetry_cost.to_doc() if self.telemetry_cost else None,
        }
        return json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def _opt_str(doc: Mapping[str, Any], key: str) -> str | None:
    value = doc.get(key)
    return value if isinstance(value, str) else None


def _opt_int(doc: Mapping[str, Any], key: str) -> int | None:
    value = doc.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str_tuple(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        return ()
    return tuple(v for v in value if isinstance(v, str))


def write_run_file(directory: Path | RunLocation, facts: RunFacts) -> None:
    publish_text(directory / HISTORY_PARTS / RUN_FILE, facts.to_json())


def read_catalog(directory: Path) -> tuple[CatalogLayer, ...] | None:
    """The layer catalog recorded in result.json, or None when it is missing or not a catalog.
    A read that fails for another reason (EIO, EACCES) raises: a catalog must not vanish from
    a finalized run because of a transient error."""
    try:
        data = json.loads((directory / RESULT_FILE).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(data, list):
        return None
    layers = []
    for record in data:
        if not isinstance(record, dict) or not isinstance(record.get("layer"), str):
            return None
        module_type = record.get("type")
        layers.append(
            CatalogLayer(
                name=record["layer"],
                module_type=module_type if isinstance(module_type, str) else "",
                aliases=_str_tuple(record.get("aliases")),
            )
        )
    return tuple(layers)


def _footer(directory: Path) -> dict[str, Any]:
    """The ``ti`` footer of a finalized ``history.parquet`` ({} when there is none or it is
    unreadable)."""
    import pyarrow.parquet as pq

    from ti_schema import parse_metadata

    try:
        return parse_metadata(pq.read_metadata(directory / HISTORY_FILE).metadata)
    except (OSError, ValueError):
        return {}


def read_run_facts(directory: Path, *, window: int | None = None) -> RunFacts:
    """Facts of the run in ``directory`` from run.json and result.json (best effort: missing or
    malformed files give unknown facts; a failing read raises); once the run is finalized
    (run.json retired), its window from the footer of history.parquet; the damaged parts a
    consolidation skipped, from ``damaged/skipped.json``; the telemetry cost from run.json, or
    from the footer once finalized."""
    try:
        doc = json.loads((directory / HISTORY_PARTS / RUN_FILE).read_text(encoding="utf-8"))
        if not isinstance(doc, dict):
            doc = {}
    except (FileNotFoundError, NotADirectoryError, ValueError):
        doc = {}
    settings = doc.get("settings")
    stored_window = _opt_int(doc, "window")
    cost = RunCost.from_doc(doc.get("telemetry_cost"))
    if not stored_window or cost is None:  # finalized: run.json is retired, the footer has them
        footer = _footer(directory)
        window_fact = footer.get("window")
        if not stored_window and isinstance(window_fact, int) and not isinstance(window_fact, bool):
            stored_window = window_fact
        cost = cost or RunCost.from_doc(footer.get("telemetry_cost"))
    facts = RunFacts(
        run_id=_opt_str(doc, "run_id"),
        rank=_opt_int(doc, "rank"),
        world_size=_opt_int(doc, "world_size"),
        producer=_opt_str(doc, "producer"),
        started_at=_opt_str(doc, "started_at"),
        layers=read_catalog(directory) or (),
        focus_layers=_str_tuple(doc.get("focus_layers")),
        metrics=_str_tuple(doc.get("metrics")),
        sampler=_opt_str(doc, "sampler"),
        window=stored_window if stored_window and stored_window > 0 else 20,
        settings={str(k): str(v) for k, v in settings.items()}
        if isinstance(settings, dict)
        else {},
        pid=_opt_int(doc, "pid"),
        host=_opt_str(doc, "host"),
        skipped=read_skipped(directory),
        telemetry_cost=cost,
    )
    return replace(facts, window=window) if window is not None else facts


_INDEX_RANK: Final[re.Pattern[str]] = re.compile(r"^rank:\s+\d+ of world size (\d+)$", re.M)
_INDEX_POLICY: Final[re.Pattern[str]] = re.compile(r'^setting:\s+"rank_policy" = (".*")$', re.M)
EVERY_RANK_POLICIES: Final[frozenset[str]] = frozenset({"'all'", "AllRanks()"})
"""How the rank policy that writes every rank is recorded (``repr`` of the argument)."""


def recorded_world(directory: Path) -> tuple[int | None, str | None]:
    """The world size and rank policy (its ``repr``) the rank run in ``directory`` recorded:
    from run.json while it is live, from index.md (ti-io's own lines) once finalized; None
    where unknown."""
    try:
        doc = json.loads((directory / HISTORY_PARTS / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        doc = None
    if isinstance(doc, dict):
        settings = doc.get("settings")
        policy = settings.get("rank_policy") if isinstance(settings, dict) else None
        return _opt_int(doc, "world_size"), policy if isinstance(policy, str) else None
    try:
        text = (directory / INDEX_FILE).read_text(encoding="utf-8")
    except OSError:
        return None, None
    size, policy = _INDEX_RANK.search(text), _INDEX_POLICY.search(text)
    try:
        recorded = json.loads(policy.group(1)) if policy else None
    except ValueError:
        recorded = None
    return (int(size.group(1)) if size else None), recorded if isinstance(recorded, str) else None


_INDEX_SETTING: Final[re.Pattern[str]] = re.compile(r'^setting:\s+(".*") = (".*")$', re.M)


def recorded_settings(directory: Path) -> dict[str, str]:
    """The run settings the rank run in ``directory`` recorded: from run.json while it is
    live, from index.md (ti-io's own lines, JSON literals) once finalized; empty where
    unknown."""
    facts = read_run_facts(directory)
    if facts.settings:
        return dict(facts.settings)
    try:
        text = (directory / INDEX_FILE).read_text(encoding="utf-8")
    except OSError:
        return {}
    found: dict[str, str] = {}
    for key, value in _INDEX_SETTING.findall(text):
        try:
            k, v = json.loads(key), json.loads(value)
        except ValueError:
            continue
        if isinstance(k, str) and isinstance(v, str):
            found[k] = v
    return found


_INDEX_RUN_LINE: Final[re.Pattern[str]] = re.compile(
    r"^(run_id|rank|producer|started_at|sampler|metrics):\s+(.+)$", re.M
)


def recorded_run_lines(directory: Path) -> dict[str, str]:
    """What index.md's run block says of the run in ``directory`` (``run_id``, ``rank``,
    ``producer``, ``started_at``, ``sampler``, ``metrics``), as printed with JSON quotes
    removed: the facts a finalized run keeps once run.json is retired; empty without index.md."""
    try:
        text = (directory / INDEX_FILE).read_text(encoding="utf-8")
    except OSError:
        return {}
    found: dict[str, str] = {}
    for key, value in _INDEX_RUN_LINE.findall(text):
        if key in found:
            continue
        try:
            items = json.loads(f"[{value}]")
        except ValueError:
            found[key] = value.strip()
            continue
        found[key] = ", ".join(str(item) for item in items)
    return found


def started_at_text(value: str | None) -> str:
    """ISO timestamp as written, or 'unknown'."""
    if value is None:
        return "unknown"
    try:
        return datetime.fromisoformat(value).isoformat()
    except ValueError:
        return value
