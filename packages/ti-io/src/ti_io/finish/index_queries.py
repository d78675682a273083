"""index.md's ready-to-run Polars queries: the run's own (a trend, the latest values, missing
values, parameter norms, low precision) and each event's dense samples, for a local run or one
on object storage."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ti_io.finish.markdown import fence, literal
from ti_schema import PRECISION_FORMATS

if TYPE_CHECKING:
    from ti_io.facts import RunFacts

EVENTS_LISTED: Final[int] = 20
"""Events index.md describes one by one (with their queries); the rest are counted."""


def example_layers(
    facts: RunFacts, layer_rows: Mapping[str, tuple[int, int]]
) -> tuple[str, list[str]]:
    """The layer the queries show (a focus layer, else one with rows) and up to three to
    compare; ``layer_rows``: rows per layer (none: the history is unknown)."""
    executed = [i.name for i in facts.layers if layer_rows.get(i.name, (0, 0))[0]]
    focus = list(facts.focus_layers)
    first = (focus or executed or [i.name for i in facts.layers] or ["encoder.0"])[0]
    compare = (focus or executed or [first])[:3]
    return first, compare


def queries(
    directory: Path | str, facts: RunFacts, layer_rows: Mapping[str, tuple[int, int]]
) -> list[str]:
    """The run's queries, for ``directory`` (a path, or the URI of a run on object storage);
    ``layer_rows``: rows per layer, which picks the example layers."""
    layer, compare = example_layers(facts, layer_rows)
    metric = "std" if "std" in facts.metrics or not facts.metrics else facts.metrics[0]
    formats = [f for f in PRECISION_FORMATS if f"underflow_fraction.{f}" in facts.metrics]
    fmt = formats[0] if formats else "float8_e4m3fn"
    run_dir = literal(str(directory))
    code = [
        "import json",
        "from pathlib import Path",
        "",
        "import polars as pl",
        "",
        f"RUN = Path({run_dir})  # this directory; change it if the run was moved",
        'history = pl.scan_parquet(RUN / "history.parquet")',
        "",
        "# One metric of one layer over time (always order by sample_id).",
        "trend = (",
        "    history.filter(",
        f'        (pl.col("layer") == {literal(layer)})',
        '        & (pl.col("signal") == "output")',
        f'        & (pl.col("metric") == {literal(metric)})',
        "    )",
        '    .select("sample_id", "timestamp", "call_index", "tensor_path", "value")',
        '    .sort("sample_id")',
        "    .collect()",
        ")",
        "",
        "# Latest value of every metric, per layer / call / signal / tensor path.",
        "latest = (",
        '    history.sort("sample_id")',
        '    .group_by("layer", "call_index", "signal", "tensor_path", "metric")',
        '    .agg(pl.col("sample_id").last(), pl.col("value").last())',
        '    .sort("layer", "call_index", "signal", "tensor_path", "metric")',
        "    .collect()",
        ")",
        "",
        "# Side by side: the mean of each sample's metric for a few layers.",
        "side_by_side = (",
        "    history.filter(",
        f'        pl.col("layer").is_in([{", ".join(literal(n) for n in compare)}])',
        f'        & (pl.col("metric") == {literal(metric)})',
        "    )",
        '    .group_by("layer", "signal")',
        '    .agg(pl.col("value").mean().alias("mean_over_samples"), pl.len().alias("rows"))',
        '    .sort("layer", "signal")',
        "    .collect()",
        ")",
        "",
        "# Why values are missing.",
        "missing = (",
        '    history.filter(pl.col("value").is_null())',
        '    .group_by("layer", "signal", "metric", "unavailable_reason")',
        '    .agg(pl.len().alias("rows"))',
        '    .sort("rows", descending=True)',
        "    .collect()",
        ")",
        "",
        "# Aggregates of one layer from result.json.",
        'records = json.loads((RUN / "result.json").read_text(encoding="utf-8"))',
        f'record = next(r for r in records if r["layer"] == {literal(layer)})',
        "",
        "# Histograms of the focus layers, without TensorBoard.",
        'histograms = pl.scan_parquet(RUN / "histograms.parquet")',
        "",
        "",
        *_parameter_queries(),
        *_precision_queries(fmt),
        "# While the run is live (before removal), read the published parts instead:",
        "# from ti_io import scan_history; live = scan_history(RUN)",
    ]
    return fence(for_location(directory, code), "python")


def _parameter_queries() -> list[str]:
    """The weight norm and the update-to-weight ratio, from the parameter signals' rows."""
    return [
        "# Parameters (recorded when the observer was given",
        '# signals=[..., "parameter", "parameter_update"]; empty frames otherwise).',
        "# The L2 norm of a tensor from its mean, std and shape: over its n finite entries,",
        "# sum(x**2) = n * (std**2 + mean**2), so ||x||_2 = sqrt(n * (std**2 + mean**2)),",
        "# n = prod(shape) * (1 - nonfinite_fraction).",
        "def l2_norm(signal):",
        "    return (",
        '        history.filter(pl.col("signal") == signal)',
        '        .group_by("layer", "tensor_path", "sample_id")',
        "        .agg(",
        '            pl.col("value").filter(pl.col("metric") == "mean").first().alias("mean"),',
        '            pl.col("value").filter(pl.col("metric") == "std").first().alias("std"),',
        '            pl.col("value")',
        '            .filter(pl.col("metric") == "nonfinite_fraction")',
        "            .first()",
        '            .alias("nonfinite"),',
        '            pl.col("shape")',
        "            .first()",
        "            .list.eval(pl.element().product())",
        "            .list.first()",
        '            .alias("numel"),',
        "        )",
        "        .with_columns(",
        "            norm=(",
        '                pl.col("numel")',
        '                * (1 - pl.col("nonfinite"))',
        '                * (pl.col("std") ** 2 + pl.col("mean") ** 2)',
        "            ).sqrt()",
        "        )",
        "    )",
        "",
        "",
        "# Weight norm per layer and parameter over time.",
        "weight_norm = (",
        '    l2_norm("parameter")',
        '    .select("layer", "tensor_path", "sample_id", "norm")',
        '    .sort("layer", "tensor_path", "sample_id")',
        "    .collect()",
        ")",
        "",
        "# Update-to-weight ratio per layer and parameter over time: how far each optimizer",
        "# step moved the parameter, relative to its size (the learning-rate diagnostic).",
        "update_to_weight = (",
        '    l2_norm("parameter_update")',
        '    .join(l2_norm("parameter"), on=["layer", "tensor_path", "sample_id"], suffix="_w")',
        "    .select(",
        '        "layer",',
        '        "tensor_path",',
        '        "sample_id",',
        '        (pl.col("norm") / pl.col("norm_w")).alias("update_to_weight"),',
        "    )",
        '    .sort("layer", "tensor_path", "sample_id")',
        "    .collect()",
        ")",
        "",
    ]


def _precision_queries(fmt: str) -> list[str]:
    """amax and dynamic range of each tensor beside what a cast to ``fmt`` would lose."""
    return [
        "# Low precision (recorded when the observer was given precision=(...); an empty",
        "# frame otherwise): amax and dynamic range of each tensor, derived from min, max and",
        "# min_abs_nonzero (amax = max(|min|, |max|), dynamic range = amax / min_abs_nonzero,",
        f"# log2 of it in binades), beside what a cast to {fmt} would lose.",
        "def value_of(metric):",
        '    return pl.col("value").filter(pl.col("metric") == metric).first()',
        "",
        "",
        "low_precision = (",
        "    history.group_by(",
        '        "layer", "call_index", "signal", "tensor_path", "sample_id", maintain_order=True',
        "    )",
        "    .agg(",
        *(
            f"        value_of({literal(name)}).alias({literal(alias)}),"
            for name, alias in (
                ("min", "min"),
                ("max", "max"),
                ("min_abs_nonzero", "min_abs_nonzero"),
                (f"underflow_fraction.{fmt}", "underflow"),
                (f"overflow_fraction.{fmt}", "overflow"),
            )
        ),
        "    )",
        '    .filter(pl.col("min_abs_nonzero").is_not_null())',
        '    .with_columns(amax=pl.max_horizontal(pl.col("min").abs(), pl.col("max").abs()))',
        "    .with_columns(",
        '        dynamic_range=pl.col("amax") / pl.col("min_abs_nonzero"),',
        '        binades=(pl.col("amax") / pl.col("min_abs_nonzero")).log(2),',
        "    )",
        '    .sort("layer", "call_index", "signal", "tensor_path", "sample_id")',
        "    .collect()",
        ")",
        "",
    ]


def event_queries(directory: Path | str, events: Sequence[Mapping[str, Any]]) -> list[str]:
    code = [
        "import polars as pl",
        "from pathlib import Path",
        "",
        f"RUN = Path({literal(str(directory))})  # this directory; change it if the run was moved",
        'history = pl.scan_parquet(RUN / "history.parquet")',
        'events = pl.read_parquet(RUN / "events.parquet")  # every event, one row each',
    ]
    for index, event in enumerate(events[:EVENTS_LISTED]):
        first, count = int(event["dense_first_forward"]), int(event["dense_forwards"])
        code += [
            "",
            f"# Event #{index} ({event['kind']} at forward {event['forward_index']}): the history "
            "rows of its dense capture.",
            f"dense_{index} = (",
            "    history.filter(",
            f'        (pl.col("rank") == {int(event["rank"])})',
            f'        & pl.col("forward_index").is_between({first}, {first + count - 1})',
            "    )",
            '    .sort("sample_id", "layer", "call_index", "signal", "tensor_path", "metric")',
            "    .collect()",
            ")",
        ]
        if event.get("layer") is not None:
            code += [
                "# ... and the non-finite fraction of the first flagged module around it.",
                f"first_module_{index} = (",
                "    history.filter(",
                f'        (pl.col("rank") == {int(event["rank"])})',
                f'        & (pl.col("layer") == {literal(str(event["layer"]))})',
                '        & (pl.col("metric") == "nonfinite_fraction")',
                "    )",
                '    .select("forward_index", "sample_id", "signal", "tensor_path", "value")',
                '    .sort("sample_id")',
                "    .collect()",
                ")",
            ]
    return fence(for_location(directory, code), "python")


_RUN_PATH: Final[re.Pattern[str]] = re.compile(r'RUN / "([^"]+)"')


def for_location(directory: Path | str, code: list[str]) -> list[str]:
    """``code`` for a run on an object store (``directory`` its URI): RUN is the URI string,
    files are ``f"{RUN}/name"`` (Polars reads them with ``storage_options``), result.json is
    read through ti-io. Unchanged for a local directory."""
    if not isinstance(directory, str):
        return code
    out = []
    for line in code:
        if line.startswith("RUN = Path("):
            line = (
                f"RUN = {literal(directory)}  # this run on object storage (Polars: add "
                "storage_options=, docs/reading-with-polars.md)"
            )
        elif '(RUN / "result.json").read_text(' in line:
            out.append("from ti_io.storage import read_text, resolve_location")
            line = 'records = json.loads(read_text(resolve_location(RUN) / "result.json") or "[]")'
        out.append(_RUN_PATH.sub(r'f"{RUN}/\1"', line))
    return out


__all__ = ["EVENTS_LISTED", "event_queries", "example_layers", "for_location", "queries"]
