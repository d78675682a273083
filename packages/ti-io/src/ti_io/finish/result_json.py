"""result.json: the history aggregated per layer, call, signal, tensor path and context.

One record per line for every catalog layer in catalog order (executed or not), then any layer
that only the history names, each with its tensors and per-metric statistics
(:mod:`ti_io.finish.statistics`, computed by :mod:`ti_io.read.aggregates`). A layer that was the
first flagged module of a ``nonfinite`` event also gets ``events`` (contract 1.3, optional): those
events, in the order they happened (every event of the run is in events.parquet). The sink publishes
the catalog's records with empty tensors at open, so this module imports Polars only when there
are aggregates to render.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ti_io.facts import LayerLike
from ti_io.publishing import publish_text
from ti_io.storage import RunLocation

if TYPE_CHECKING:
    import polars as pl

_ENCODE: Final = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode


def render(
    catalog: Iterable[LayerLike],
    aggregated: pl.DataFrame | None,
    *,
    window: int,
    metrics: Sequence[str] = (),
    events: Sequence[Mapping[str, Any]] = (),
) -> str:
    """result.json's text: one record per line for every catalog layer in catalog order
    (executed or not), then any layer that only the history names, each with its tensors and
    per-metric statistics (``metrics``: the run's, in order). ``events``
    (:func:`ti_io.read.events.event_records`) go under the record of their first flagged
    module (``layer``); events without one (manual, loss) are not repeated here.

    The 18,000 statistics objects of a 1,000-layer model are formatted from columns (one C
    encoder call per aggregate column, then one string template per object) rather than
    built as Python dicts and encoded one by one.
    """
    heads: dict[str, tuple[str, list[str]]] = {}
    for info in catalog:
        if info.name not in heads:
            heads[info.name] = (info.module_type, list(info.aliases))
    by_layer: dict[str, list[str]] = {}
    for event in events:
        layer = event.get("layer")
        if isinstance(layer, str):
            by_layer.setdefault(layer, []).append(_ENCODE(dict(event)))
            if layer not in heads:
                heads[layer] = (str(event.get("module_type") or ""), [])
    tensors: dict[str, list[str]] = {name: [] for name in heads}
    if aggregated is not None and aggregated.height:
        from ti_io.finish.statistics import finish_statistics, tensor_objects
        from ti_io.read.ordering import ordered

        finished = finish_statistics(aggregated, window)
        rows = ordered(finished, layers=list(heads), metrics=metrics)
        tensor_objects(rows, heads, tensors)
    lines = [
        _ENCODE({"layer": name, "type": module_type, "aliases": aliases})[:-1]
        + ', "tensors": ['
        + ", ".join(tensors[name])
        + "]"
        + (', "events": [' + ", ".join(by_layer[name]) + "]" if name in by_layer else "")
        + "}"
        for name, (module_type, aliases) in heads.items()
    ]
    if not lines:
        return "[]\n"
    return "[\n" + ",\n".join(lines) + "\n]\n"


def write_result_json(path: Path | RunLocation, text: str) -> None:
    """Publish result.json (the text of :func:`render`) atomically."""
    publish_text(path, text)
