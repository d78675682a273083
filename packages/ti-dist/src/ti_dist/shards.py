"""Combine the shards of a sharded parameter (FSDP2 ``fully_shard``) into whole-tensor rows.

Each rank measures the shard it holds; its rows say so in ``tensor_path``: the parameter's name,
``@`` and its placements (``weight@S(0)``: sharded on dim 0 of a one-dimensional mesh;
docs/data-contract.md, "Signals"). The statistics of the whole parameter follow exactly from
each shard's and its size, for what is a sum or an extreme:

- ``n_r`` finite entries of rank ``r``: ``prod(shape_r) * (1 - nonfinite_fraction_r)``;
- ``mean = sum_r n_r mean_r / N`` with ``N = sum_r n_r``;
- ``std = sqrt(sum_r n_r (std_r**2 + (mean_r - mean)**2) / N)`` (population std);
- ``min``/``max``: the smallest / largest of the shards';
- ``zero_fraction``, ``nonfinite_fraction``: weighted by ``prod(shape_r)``.

Quartiles are order statistics of the whole tensor; the shards' quartiles do not determine
them, so ``p25``, ``p50`` and ``p75`` are null with a reason (as are custom metrics). Only
tensors on a one-dimensional mesh sharded on one dim (``@S(d)``) are combined; replicated or
several-dimensional placements (``@R``, ``@R,S(0)``) are left alone.
"""

from __future__ import annotations

import math
import os
from typing import Any, Final

import polars as pl

from ti_dist.compare import AlignOn
from ti_dist.reading import scan_ranks
from ti_schema import DEFAULT_METRICS

KEY: Final[tuple[str, ...]] = ("layer", "call_index", "signal", "tensor_path")
"""One sharded tensor; rows also line up on ``sample_id`` (or ``forward_index``)."""

SHARD_PATH: Final[str] = r"^(?P<name>.*)@S\((?P<dim>\d+)\)$"
"""A ``tensor_path`` of a tensor sharded on one dim of a one-dimensional mesh."""

QUARTILE_REASON: Final[str] = (
    "not combinable: the quartiles of a sharded tensor do not follow from its shards' "
    "quartiles (each rank's own rows have them)"
)
CUSTOM_REASON: Final[str] = "not combinable: a custom metric (only the default profile combines)"
NO_FINITE_REASON: Final[str] = "no finite entries"
MISSING_REASON: Final[str] = "not combinable: the shards of ranks {ranks} are missing"
UNAVAILABLE_REASON: Final[str] = (
    "not combinable: a value needed is unavailable on rank(s) {ranks} (see their rows)"
)

_COMBINED: Final[tuple[str, ...]] = (
    "mean",
    "std",
    "min",
    "max",
    "zero_fraction",
    "nonfinite_fraction",
)


def _frame(source: str | os.PathLike[str] | pl.LazyFrame | pl.DataFrame) -> pl.LazyFrame:
    if isinstance(source, pl.DataFrame):
        return source.lazy()
    if isinstance(source, pl.LazyFrame):
        return source
    if isinstance(source, (str, os.PathLike)):
        return scan_ranks(source)
    raise TypeError(
        "source must be an output_dir path or a polars LazyFrame/DataFrame of ti.history "
        f"rows, got {type(source).__name__}"
    )


def combine_shards(
    source: str | os.PathLike[str] | pl.LazyFrame | pl.DataFrame,
    *,
    align_on: AlignOn = "sample_id",
) -> pl.DataFrame:
    """Whole-tensor rows of every sharded tensor (``tensor_path`` ending in ``@S(d)``).

    ``source``: a run's ``output_dir`` (read with :func:`~ti_dist.scan_ranks`) or a frame of
    ``ti.history`` rows of every rank (``rank_policy="all"``). One output row per layer, call,
    signal, tensor path, ``align_on`` value and default metric: ``parameter`` (the name without
    the placement), ``shape`` (the whole tensor's: the shards' sizes along the sharded dim
    summed), ``n_ranks``, ``ranks``, ``value`` and ``unavailable_reason`` (null exactly when
    ``value`` is not). A tensor is combined only when every rank of the source holds a row for
    it at that sample; otherwise its values are null, naming the missing ranks. Formulas and
    what cannot be combined: this module's docstring.
    """
    if align_on not in ("sample_id", "forward_index"):
        raise ValueError(f"align_on must be 'sample_id' or 'forward_index', got {align_on!r}")
    frame = _frame(source)
    all_ranks = frame.select(pl.col("rank").unique().sort()).collect()["rank"].to_list()
    key = [*KEY, align_on]
    sharded = frame.filter(pl.col("tensor_path").str.contains(SHARD_PATH)).with_columns(
        pl.col("tensor_path").str.extract(SHARD_PATH, 1).alias("parameter"),
        pl.col("tensor_path").str.extract(SHARD_PATH, 2).cast(pl.Int64).alias("_dim"),
        pl.col("value").cast(pl.Float64),
    )

    def metric(name: str) -> pl.Expr:
        return pl.col("value").filter(pl.col("metric") == name).first().alias(name)

    per_rank = sharded.group_by([*key, "rank"]).agg(
        pl.col("parameter").first(),
        pl.col("_dim").first(),
        pl.col("shape").first(),
        *(metric(name) for name in _COMBINED),
    )
    # One row per tensor and sample, every rank's shard statistics as lists in rank order; the
    # combination itself is a few arithmetic operations per tensor (_combine).
    grouped = (
        per_rank.sort("rank")
        .group_by(key)
        .agg(
            pl.col("parameter").first(),
            pl.col("_dim").first(),
            pl.col("rank").alias("ranks"),
            pl.col("shape").alias("shapes"),
            *(pl.col(name).alias(f"{name}s") for name in _COMBINED),
        )
        .collect()
    )
    rows = [
        row for group in grouped.iter_rows(named=True) for row in _combine(group, key, all_ranks)
    ]
    schema: dict[str, Any] = {
        "layer": pl.String,
        "call_index": pl.Int32,
        "signal": pl.String,
        "tensor_path": pl.String,
        align_on: pl.Int64,
        "parameter": pl.String,
        "shape": pl.List(pl.Int64),
        "n_ranks": pl.Int64,
        "ranks": pl.List(pl.Int32),
        "metric": pl.String,
        "value": pl.Float64,
        "unavailable_reason": pl.String,
    }
    return pl.DataFrame(rows, schema=schema, orient="row").sort([*key, "metric"])


def _whole_shape(shapes: list[list[int]], dim: int) -> list[int]:
    """The shards' shape with their sizes along ``dim`` summed."""
    whole = list(shapes[0])
    if len(whole) > dim:
        whole[dim] = sum(s[dim] for s in shapes)
    return whole


def _combine(group: dict[str, Any], key: list[str], all_ranks: list[int]) -> list[dict[str, Any]]:
    """The default-profile rows of one sharded tensor at one sample (module docstring)."""
    ranks = [int(r) for r in group["ranks"]]
    shapes = [list(s) for s in group["shapes"]]
    base = {name: group[name] for name in key}
    base.update(
        parameter=group["parameter"],
        shape=_whole_shape(shapes, int(group["_dim"])),
        n_ranks=len(ranks),
        ranks=ranks,
    )
    values: dict[str, float | None] = dict.fromkeys(DEFAULT_METRICS)
    reasons: dict[str, str] = dict.fromkeys(("p25", "p50", "p75"), QUARTILE_REASON)
    shards = list(
        zip(
            ranks,
            [math.prod(s) for s in shapes],
            *(group[f"{name}s"] for name in _COMBINED),
            strict=True,
        )
    )
    missing = [r for r in all_ranks if r not in ranks]
    # A shard with entries must have every value the formulas use (std only when it has finite
    # entries); an empty shard contributes nothing and needs nothing.
    lacking = [
        rank
        for rank, numel, mean, std, low, high, zeros, nonfinite in shards
        if numel
        and (
            zeros is None or nonfinite is None or (nonfinite < 1 and None in (mean, std, low, high))
        )
    ]
    if missing or lacking:
        reason = (
            MISSING_REASON.format(ranks=missing)
            if missing
            else UNAVAILABLE_REASON.format(ranks=lacking)
        )
        reasons = dict.fromkeys(DEFAULT_METRICS, reason)
    else:
        entries = sum(numel for _, numel, *_ in shards)
        finite = [
            (numel * (1 - nonfinite), mean, std, low, high)
            for _, numel, mean, std, low, high, _, nonfinite in shards
            if numel and nonfinite < 1
        ]
        if entries:
            values["zero_fraction"] = sum(n * z for _, n, *_, z, _ in shards if n) / entries
            values["nonfinite_fraction"] = sum(n * f for _, n, *_, f in shards if n) / entries
        total = sum(n for n, *_ in finite)
        if total > 0:
            mean = sum(n * m for n, m, *_ in finite) / total
            spread = sum(n * (s * s + (m - mean) ** 2) for n, m, s, _, _ in finite)
            values.update(
                mean=mean,
                std=math.sqrt(spread / total),
                min=min(low for *_, low, _ in finite),
                max=max(high for *_, high in finite),
            )
        else:
            reasons.update(dict.fromkeys(("mean", "std", "min", "max"), NO_FINITE_REASON))
            if not entries:
                reason = "empty tensor (numel=0)"
                reasons.update(dict.fromkeys(("zero_fraction", "nonfinite_fraction"), reason))
    return [
        {
            **base,
            "metric": name,
            "value": values[name],
            "unavailable_reason": None if values[name] is not None else reasons[name],
        }
        for name in DEFAULT_METRICS
    ]


__all__ = ["QUARTILE_REASON", "SHARD_PATH", "combine_shards"]
