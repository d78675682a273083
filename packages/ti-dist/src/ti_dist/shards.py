"""Combine the shards of a sharded tensor into whole-tensor rows: FSDP2 ``fully_shard``
parameters, and tensor- or sequence-parallel outputs and output gradients (DTensors).

Each rank measures the shard it holds; its rows say so in ``tensor_path``: the tensor's position
(a parameter's name, an output's pytree position), ``@`` and its placements (``weight@S(0)``:
sharded on dim 0 of a one-dimensional mesh), and ``#`` with the mesh's ranks when the mesh does
not span the job (``@S(1)#2,3``: a tensor-parallel submesh; only those ranks are combined;
``ti_schema.placements``, docs/data-contract.md, "Signals"). How each metric combines is
declared with the metric (``ti_schema.MetricSpec.combine``, :data:`ti_schema.DEFAULT_PROFILE`);
this module applies each rule once, for every metric that declares it. With ``n_r`` the finite
entries of rank ``r`` (``prod(shape_r) * (1 - nonfinite_fraction_r)``) and ``N = sum_r n_r``:

- ``finite_mean`` (``mean``): ``sum_r n_r mean_r / N``;
- ``pooled_std`` (``std``): ``sqrt(sum_r n_r (std_r**2 + (mean_r - mean)**2) / N)``, around
  the metric it is pooled with (population std);
- ``min`` / ``max``: the smallest / largest of the shards';
- ``root_mean_square`` (``rms``, a stability metric): ``sqrt(sum_r n_r rms_r**2 / N)``;
- ``entry_mean`` (``zero_fraction``, ``nonfinite_fraction``, the precision fractions):
  the shards' counts (``round(prod(shape_r) * fraction_r)``) added, over the whole tensor's
  element count: exact;
- a ``min`` metric that may be null on a shard with finite entries (``min_abs_nonzero``,
  ``MetricSpec.null_reason``) is the smallest of the shards that have one.

A metric that declares no rule (the quartiles: order statistics of the whole tensor, which the
shards' quartiles do not determine) is null with the declared reason, as are custom metrics
(no rows). Only tensors on a one-dimensional mesh sharded on one dim (``@S(d)``) are combined;
replicated or several-dimensional placements (``@R``, ``@R,S(0)``) are left alone.
"""

from __future__ import annotations

import math
import re
from typing import Any, Final

import polars as pl

from ti_dist.compare import AlignOn
from ti_dist.partitions import RankPartitions
from ti_io.read.frames import PathOrFrame
from ti_schema import DEFAULT_PROFILE, MetricProfile, MetricSpec, profile_of

KEY: Final[tuple[str, ...]] = ("layer", "call_index", "signal", "tensor_path")
"""One sharded tensor; rows also line up on ``sample_id`` (or ``forward_index``)."""

SHARD_PATH: Final[str] = r"^(?P<name>.*)@S\((?P<dim>\d+)\)(?:#(?P<ranks>\d+(?:,\d+)*))?$"
"""A ``tensor_path`` of a tensor sharded on one dim of a one-dimensional mesh, with the mesh's
ranks when it does not span the job (``ti_schema.placements``)."""

FINITE_WEIGHT: Final[str] = "nonfinite_fraction"
"""The metric every shard's finite-entry count follows from (the weights of the rules)."""

NOT_COMBINABLE_REASON: Final[str] = "not combinable: {why} (each rank's own rows have them)"
QUARTILE_REASON: Final[str] = NOT_COMBINABLE_REASON.format(
    why=DEFAULT_PROFILE.get("p50").not_combinable
)
NO_FINITE_REASON: Final[str] = "no finite entries"
EMPTY_REASON: Final[str] = "empty tensor (numel=0)"
MISSING_REASON: Final[str] = "not combinable: the shards of ranks {ranks} are missing"
UNAVAILABLE_REASON: Final[str] = (
    "not combinable: a value needed is unavailable on rank(s) {ranks} (see their rows)"
)


def _combined(profile: MetricProfile) -> tuple[str, ...]:
    """The metrics whose shard values a combination reads: every one with a rule, and the
    finite weights."""
    if FINITE_WEIGHT not in profile:
        raise ValueError(
            f"combining shards needs the metric {FINITE_WEIGHT!r} (each shard's finite entries "
            f"follow from it); the profile has {list(profile.names)}"
        )
    names = [m.name for m in profile if m.combine is not None]
    return (*names, FINITE_WEIGHT) if FINITE_WEIGHT not in names else tuple(names)


def combine_shards(
    source: PathOrFrame,
    *,
    align_on: AlignOn = "sample_id",
    profile: MetricProfile | None = None,
) -> pl.DataFrame:
    """Whole-tensor rows of every sharded tensor (``tensor_path`` ending in ``@S(d)``).

    ``source``: a run's ``output_dir`` (every rank's rows of the sharded tensors, read a range
    of steps at a time: :class:`~ti_dist.partitions.RankPartitions`) or a frame of
    ``ti.history`` rows of every rank (``rank_policy="all"``). One output row per layer, call,
    signal, tensor path, ``align_on`` value and metric of ``profile`` (the declaration whose
    combination rules apply; default: the default profile and the declared precision metrics
    the source holds, ``ti_schema.profile_of``; a test may pass an extended one): ``parameter``
    (the name without the placement), ``shape`` (the whole tensor's: the shards' sizes along
    the sharded dim summed), ``n_ranks``, ``ranks``, ``value`` and ``unavailable_reason`` (null
    exactly when
    ``value`` is not). A tensor is combined only when every rank of the source holds a row for
    it at that sample; otherwise its values are null, naming the missing ranks. Formulas and
    what cannot be combined: this module's docstring.
    """
    if align_on not in ("sample_id", "forward_index"):
        raise ValueError(f"align_on must be 'sample_id' or 'forward_index', got {align_on!r}")
    shard = re.compile(SHARD_PATH)

    def keep(measurement: dict[str, Any]) -> bool:
        return bool(shard.match(measurement["tensor_path"] or ""))

    key = [*KEY, align_on]
    with RankPartitions(source, align=align_on, keep=keep, extra=("shape",)) as parts:
        if profile is None:
            profile = profile_of(parts.metrics)
        chosen = profile
        rows = [
            row
            for frame in parts.frames()
            for row in _combined_rows(frame.lazy(), key, parts.ranks, chosen)
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


def _combined_rows(
    frame: pl.LazyFrame, key: list[str], all_ranks: list[int], profile: MetricProfile
) -> list[dict[str, Any]]:
    """The whole-tensor rows of the steps ``frame`` holds (every rank's rows of them)."""
    combined = _combined(profile)
    frame = frame.with_columns(pl.col(pl.Categorical).cast(pl.String))  # a partition's strings
    sharded = frame.filter(pl.col("tensor_path").str.contains(SHARD_PATH)).with_columns(
        pl.col("tensor_path").str.extract(SHARD_PATH, 1).alias("parameter"),
        pl.col("tensor_path").str.extract(SHARD_PATH, 2).cast(pl.Int64).alias("_dim"),
        pl.col("tensor_path").str.extract(SHARD_PATH, 3).alias("_mesh"),
        pl.col("value").cast(pl.Float64),
    )

    def metric(name: str) -> pl.Expr:
        return pl.col("value").filter(pl.col("metric") == name).first().alias(name)

    per_rank = sharded.group_by([*key, "rank"]).agg(
        pl.col("parameter").first(),
        pl.col("_dim").first(),
        pl.col("_mesh").first(),
        pl.col("shape").first(),
        *(metric(name) for name in combined),
    )
    # One row per tensor and sample, every rank's shard statistics as lists in rank order; the
    # combination itself is a few arithmetic operations per tensor (_combine).
    grouped = (
        per_rank.sort("rank")
        .group_by(key)
        .agg(
            pl.col("parameter").first(),
            pl.col("_dim").first(),
            pl.col("_mesh").first(),
            pl.col("rank").alias("ranks"),
            pl.col("shape").alias("shapes"),
            *(pl.col(name).alias(f"{name}s") for name in combined),
        )
        .collect()
    )
    return [
        row
        for group in grouped.iter_rows(named=True)
        for row in _combine(group, key, all_ranks, profile)
    ]


def _whole_shape(shapes: list[list[int]], dim: int) -> list[int]:
    """The shards' shape with their sizes along ``dim`` summed."""
    whole = list(shapes[0])
    if len(whole) > dim:
        whole[dim] = sum(s[dim] for s in shapes)
    return whole


def _combine(
    group: dict[str, Any], key: list[str], all_ranks: list[int], profile: MetricProfile
) -> list[dict[str, Any]]:
    """The rows of one sharded tensor at one sample, one per metric of ``profile`` (module
    docstring)."""
    ranks = [int(r) for r in group["ranks"]]
    shapes = [list(s) for s in group["shapes"]]
    base = {name: group[name] for name in key}
    base.update(
        parameter=group["parameter"],
        shape=_whole_shape(shapes, int(group["_dim"])),
        n_ranks=len(ranks),
        ranks=ranks,
    )
    numels = [math.prod(s) for s in shapes]
    shard_values = [
        {name: group[f"{name}s"][r] for name in _combined(profile)} for r in range(len(ranks))
    ]
    values: dict[str, float | None] = dict.fromkeys(profile.names)
    reasons: dict[str, str] = {
        m.name: NOT_COMBINABLE_REASON.format(why=m.not_combinable)
        for m in profile
        if m.combine is None
    }
    # a mesh that does not span the job names its ranks in the path (a tensor-parallel
    # submesh of a 2D mesh): only they hold parts of this tensor
    mesh = group["_mesh"]
    holders = [int(r) for r in mesh.split(",")] if mesh else all_ranks
    missing = [r for r in holders if r not in ranks]
    # A shard with entries must have every value the rules use (those over the finite entries
    # only when it has finite entries); an empty shard contributes nothing and needs nothing.
    lacking = [
        rank
        for rank, numel, shard in zip(ranks, numels, shard_values, strict=True)
        if numel and any(shard[m] is None for m in _needed(profile, shard))
    ]
    if missing or lacking:
        reason = (
            MISSING_REASON.format(ranks=missing)
            if missing
            else UNAVAILABLE_REASON.format(ranks=lacking)
        )
        reasons = dict.fromkeys(profile.names, reason)
    else:
        _apply_rules(profile, numels, shard_values, values, reasons)
    return [
        {
            **base,
            "metric": name,
            "value": values[name],
            "unavailable_reason": None if values[name] is not None else reasons[name],
        }
        for name in profile.names
    ]


def _needed(profile: MetricProfile, shard: dict[str, Any]) -> list[str]:
    """The metrics a shard with entries must have for the rules."""
    has_finite = shard[FINITE_WEIGHT] is not None and shard[FINITE_WEIGHT] < 1
    return [
        m.name
        for m in profile
        if m.combine is not None and not m.null_reason and (m.over == "all" or has_finite)
    ] + [FINITE_WEIGHT]


def _apply_rules(
    profile: MetricProfile,
    numels: list[int],
    shards: list[dict[str, Any]],
    values: dict[str, float | None],
    reasons: dict[str, str],
) -> None:
    """Each metric's declared rule over the shards (which hold every value they need)."""
    entries = sum(numels)
    # (finite entries, values) of each shard that has finite entries, in rank order
    finite = [
        (numel * (1 - shard[FINITE_WEIGHT]), shard)
        for numel, shard in zip(numels, shards, strict=True)
        if numel and shard[FINITE_WEIGHT] < 1
    ]
    total = sum(n for n, _ in finite)
    rules: list[MetricSpec] = [m for m in profile if m.combine is not None]
    # finite_mean first: a pooled_std reads the combined mean it is pooled around
    rules.sort(key=lambda m: m.combine != "finite_mean")
    for m in rules:
        name = m.name
        if m.combine == "entry_mean":
            if entries:
                # each shard's fraction is a count over its entries: add the counts
                counts = (round(n * s[name]) for n, s in zip(numels, shards, strict=True) if n)
                values[name] = sum(counts) / entries
            else:
                reasons[name] = EMPTY_REASON
        elif total <= 0:
            reasons[name] = NO_FINITE_REASON
        elif m.combine == "finite_mean":
            values[name] = sum(n * s[name] for n, s in finite) / total
        elif m.combine == "root_mean_square":
            values[name] = math.sqrt(sum(n * s[name] * s[name] for n, s in finite) / total)
        elif m.combine == "pooled_std":
            center, mean = values[m.pooled_with], m.pooled_with
            assert center is not None  # combined before, from the same shards
            spread = sum(n * (s[name] * s[name] + (s[mean] - center) ** 2) for n, s in finite)
            values[name] = math.sqrt(spread / total)
        elif m.combine in ("min", "max"):
            # a metric with a null_reason may be null on a shard that has finite entries
            present = [s[name] for _, s in finite if s[name] is not None]
            if present:
                values[name] = min(present) if m.combine == "min" else max(present)
            else:
                reasons[name] = m.null_reason or NO_FINITE_REASON


__all__ = ["QUARTILE_REASON", "SHARD_PATH", "combine_shards"]
