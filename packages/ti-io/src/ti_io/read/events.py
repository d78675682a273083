"""Reading a run's events (``ti.events``): ``read_events`` / ``scan_events``, and their words.

``events.parquet`` once the run is finalized, else the parts published so far in
``events.parts/`` (each event is published at once, so a live or killed run shows every event
it had). A run without events has an empty table; so does a run finalized before contract 1.3
(no events were recorded then). Every file is verified first (its page checksums,
:mod:`ti_io.integrity`). Pure pyarrow except :func:`scan_events`, which imports Polars when
called: the finalization and the sink use this module without loading Polars.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ti_io.integrity import open_verified, read_error
from ti_schema import EVENT_COLUMNS, events_schema, parse_metadata
from ti_schema.layout import (
    EVENT_PARTS,
    EVENTS_FILE,
    HISTORY_FILE,
    HISTORY_PARTS,
    list_parts,
    list_rank_dirs,
)
from ti_schema.result_json import EVENT_KEYS, OPTIONAL_EVENT_KEYS

if TYPE_CHECKING:
    import polars as pl

EVENT_SUMMARY_KEYS: tuple[str, ...] = (*EVENT_KEYS, *OPTIONAL_EVENT_KEYS)
"""The keys of each event in result.json (and of :func:`event_records`), in order."""


def read_event_file(path: Path) -> pa.Table:
    """One events file (``events.parquet`` or a part), every page verified, in the contract's
    column order; a column a file of an older minor lacks (``replay``, ``replay_reason``:
    1.5) is read as nulls. DamagedFileError naming the file when it is damaged."""
    with open_verified(path) as source:
        try:
            table = source.read(use_threads=False)
        except (OSError, pa.ArrowException) as exc:
            raise read_error(path, exc) from None
    schema = events_schema()
    for field in schema:
        if field.name not in table.column_names:
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return table.select(list(EVENT_COLUMNS))


def concat_events(tables: list[pa.Table], producer: str | None = None) -> pa.Table:
    """``tables`` as one ``ti.events`` table of ``events_schema(producer)`` (the first table's
    producer when None), in their order."""
    if producer is None and tables:
        try:
            found = parse_metadata(tables[0].schema).get("producer")
        except (ValueError, TypeError):
            found = None
        producer = found if isinstance(found, str) else None
    schema = events_schema(producer)
    if not tables:
        return schema.empty_table()
    return pa.concat_tables([t.cast(schema) for t in tables])


def _event_sources(directory: Path, function: str) -> list[Path]:
    """The files holding the run's events (empty: none recorded); FileNotFoundError naming
    what to pass when ``directory`` holds no run."""
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{function}({str(directory)!r}): no such directory; pass a run's output_dir"
        )
    final = directory / EVENTS_FILE
    if final.is_file():
        return [final]
    if (directory / EVENT_PARTS).is_dir():
        return list_parts(directory / EVENT_PARTS)
    if (directory / HISTORY_FILE).is_file() or (directory / HISTORY_PARTS).is_dir():
        return []  # a run without events.parts/: finalized before contract 1.3 (no events)
    ranks = [child.name for _, child in list_rank_dirs(directory)]
    if ranks:
        raise FileNotFoundError(
            f"{directory} holds rank-private runs ({', '.join(ranks[:4])}"
            f"{', ...' if len(ranks) > 4 else ''}); read them together with "
            f"ti_dist.events_across_ranks(output_dir), or one rank with "
            f"{function}({str(directory / ranks[0])!r})"
        )
    raise FileNotFoundError(
        f"{directory} holds no run: neither {HISTORY_FILE} nor {HISTORY_PARTS}/ is there"
    )


def read_events(output_dir: str | os.PathLike[str]) -> pa.Table:
    """A run's events as a pyarrow Table of ``ti.events`` (``ti_schema.events_schema()``), in
    the order they happened (part order, ``event_id``); empty when the run had none.

    Reads ``events.parquet`` once the run is finalized, else the parts in ``events.parts/``
    (a live or interrupted run). Every file is verified first: a damaged one raises
    ``ti_io.DamagedFileError`` naming it. FileNotFoundError when ``output_dir`` holds no run
    (for rank-private runs use ``ti_dist.events_across_ranks``).
    """
    directory = Path(output_dir)
    return concat_events([read_event_file(p) for p in _event_sources(directory, "read_events")])


def scan_events(output_dir: str | os.PathLike[str]) -> pl.LazyFrame:
    """A Polars LazyFrame over a run's events (:func:`read_events`, the same rows and
    order): the dense samples after an event are the history rows whose ``forward_index``
    lies in ``[dense_first_forward, dense_first_forward + dense_forwards - 1]`` on its rank
    (docs/data-contract.md has the query)."""
    import polars as pl

    frame = pl.from_arrow(read_events(output_dir))
    assert isinstance(frame, pl.DataFrame)
    return frame.lazy()


def _json_value(value: Any) -> Any:
    if isinstance(value, _dt.datetime):
        return value.isoformat()
    return value


def event_records(table: pa.Table) -> list[dict[str, Any]]:
    """One dict per event with the keys of :data:`EVENT_SUMMARY_KEYS` (timestamps as ISO
    8601 strings; a non-finite ``value`` as null; the optional ``replay`` keys only where a
    replay ran): what result.json and index.md show."""
    if not table.num_rows:
        return []
    records = []
    for row in table.select(list(EVENT_SUMMARY_KEYS)).to_pylist():
        record = {
            key: _json_value(row[key])
            for key in EVENT_SUMMARY_KEYS
            if key in EVENT_KEYS or row["replay"] is not None
        }
        value = record["value"]
        if isinstance(value, float) and (value != value or value in (float("inf"), -float("inf"))):
            record["value"] = None  # strict JSON; the exact value stays in events.parquet
        records.append(record)
    return records


def _name(text: str) -> str:
    """A module name safe to print on one line (control characters escaped, root shown)."""
    if not text:
        return "(root)"
    return text if text.isprintable() else json.dumps(text, ensure_ascii=False)[1:-1]


def describe_event(event: Mapping[str, Any]) -> str:
    """One line for a person: kind, forward, signal, first module, rank (``ti summary``)."""
    words = [f"{event['kind']} at forward {event['forward_index']}"]
    if event.get("signal") is not None:
        words.append(f"signal {event['signal']}")
    if event.get("layer") is not None:
        module_type = event.get("module_type")
        typed = f" ({module_type})" if module_type else ""
        words.append(f"first module {_name(str(event['layer']))}{typed}")
        more = len(event.get("layers") or ()) - 1
        if more > 0:
            words.append(f"{more} more flagged")
    if event.get("reason") is not None:
        words.append(f"reason {json.dumps(str(event['reason']), ensure_ascii=False)}")
    if event.get("value") is not None:
        words.append(f"value {event['value']!r}")
    words.append(f"rank {event['rank']}")
    if event.get("replay") is not None:
        because = event.get("replay_reason")
        words.append(f"replay {event['replay']}" + (f" ({because})" if because else ""))
    first, count = event.get("dense_first_forward"), event.get("dense_forwards")
    if count and first is not None:
        words.append(f"dense forwards {first}..{int(first) + int(count) - 1}")
    return ", ".join(words)


__all__ = [
    "EVENT_SUMMARY_KEYS",
    "concat_events",
    "describe_event",
    "event_records",
    "read_event_file",
    "read_events",
    "scan_events",
]
