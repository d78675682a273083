"""Replica drift: whether every rank held the same parameters at the same sampled step.

Under data parallelism (DDP, or an explicit all-reduce of the gradients) every rank's parameters
must be bit-identical after each step; a non-deterministic kernel, a missed all-reduce or a rank
that skipped a step forks training silently. With the ``parameter`` signal recorded on every rank
(``rank_policy="all"``) and the same forwards sampled on every rank, each rank's statistics of
each parameter at each sampled forward line up here, metric by metric, and either agree exactly
or show which ranks hold another value.

**Agree** means every rank stored the same float64 for the metric: ``==``, except that ``-0.0``
and ``+0.0`` differ (their bits do) and NaN agrees with NaN (a metric NaN on every rank is the
same reading; NaN payloads are not compared). A null value (unavailable) agrees only with null.
Nothing is tolerated: drift is any difference, however small.

What it can and cannot see: identical parameters give identical statistics when every rank
computes them the same way (same device type and kernels); ranks computing on different hardware
may differ in the last bit with identical parameters. Conversely, equal statistics do not prove
equal tensors (a change that keeps every recorded metric is invisible), though a perturbed
element moves the mean and the norm-like metrics of a float tensor in practice.

Rows line up by ``forward_index`` (the root forward the sample belongs to, the same training step
on every rank). A measurement some rank of the run lacks (that rank did not sample that forward,
or did not write that parameter) is not compared: its ``missing_ranks`` name the ranks and its
``agree`` is null, never a silent comparison of unaligned rows.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import polars as pl

from ti_dist.partitions import RankPartitions, plain
from ti_io.progress import ProgressCallback
from ti_io.read.filters import names, signal_names
from ti_io.read.frames import PathOrFrame
from ti_schema import DEFAULT_METRICS, PARAMETER_SIGNALS, Signal

DRIFT_KEY: Final[tuple[str, ...]] = ("forward_index", "signal", "layer", "tensor_path", "metric")
"""What lines a measurement up across ranks: the sampled step, the parameter and the metric."""

DRIFT_COLUMNS: Final[tuple[str, ...]] = (
    *DRIFT_KEY,
    "n_ranks",
    "agree",
    "differing_ranks",
    "missing_ranks",
    "reference",
    "min",
    "max",
    "spread",
    "ranks",
    "values",
)
"""The columns of :func:`replica_drift`, in order."""


@dataclass(frozen=True)
class Drift:
    """The first sampled step and parameter where the ranks hold different values
    (:func:`first_drift`)."""

    forward_index: int
    signal: str
    layer: str
    tensor_path: str
    ranks: tuple[int, ...]
    """The ranks compared (every rank of the run)."""
    differing_ranks: tuple[int, ...]
    """The ranks whose value differs from the reference in at least one metric."""
    differing_metrics: tuple[str, ...]
    """The metrics in which some rank differs, in the order of :attr:`values`."""
    metric_differing_ranks: dict[str, tuple[int, ...]]
    """Metric -> the ranks whose value of it is not the reference (empty where all agree)."""
    reference: dict[str, float | None]
    """Metric -> the value most ranks hold (a tie: the value the lowest of them holds)."""
    values: dict[str, dict[int, float | None]]
    """Metric -> rank -> the value that rank stored, for every metric of this parameter here
    (the default profile's metrics in its order, then the others by name)."""
    parameters_differing: int
    """How many parameters (``layer``, ``tensor_path``, ``signal``) differ at this step,
    this one included."""

    @property
    def parameter(self) -> str:
        """The parameter's qualified name, as ``named_parameters()`` of the model gives it."""
        return f"{self.layer}.{self.tensor_path}" if self.layer else self.tensor_path


def _where(source: PathOrFrame) -> str:
    return repr(os.fspath(source)) if isinstance(source, str | os.PathLike) else "the frame"


def _refuse_several_runs(rows: pl.DataFrame) -> None:
    """Raise when some rank has more than one row for one measurement (several runs mixed)."""
    counts = rows.group_by([*DRIFT_KEY, "rank"]).agg(
        pl.len().alias("n"), pl.col("run_id").unique().sort().alias("run_ids")
    )
    repeated = counts.filter(pl.col("n") > 1).sort([*DRIFT_KEY, "rank"])
    if not repeated.height:
        return
    first = repeated.row(0, named=True)
    raise ValueError(
        f"rank {first['rank']} has {first['n']} rows for one measurement (layer="
        f"{first['layer']!r}, tensor_path={first['tensor_path']!r}, metric={first['metric']!r}, "
        f"forward_index={first['forward_index']}), from run_ids {first['run_ids']}: the data "
        "holds more than one run per rank; filter by run_id before reading replica drift"
    )


@contextlib.contextmanager
def _partitions(
    source: PathOrFrame,
    signals: list[str],
    layers: list[str] | None,
    metrics: list[str] | None,
    progress: ProgressCallback | None = None,
) -> Iterator[tuple[RankPartitions, list[int]]]:
    """The selected parameter-signal rows of every rank, a range of forwards at a time
    (:class:`~ti_dist.partitions.RankPartitions`), and every rank of the run (sorted). Raises
    the errors of a source that holds nothing to compare."""

    def keep(key: dict[str, Any]) -> bool:
        return (
            key["signal"] in signals
            and (layers is None or key["layer"] in layers)
            and (metrics is None or key["metric"] in metrics)
        )

    with RankPartitions(source, align="forward_index", keep=keep, progress=progress) as parts:
        run_ranks = parts.ranks
        if not parts.kept_rows:
            held = parts.measurements().get_column("signal").to_list()
            if any(signal in signals for signal in held):
                raise ValueError(
                    f"no {signals} rows with layer={layers!r} and metric={metrics!r} in "
                    f"{_where(source)}; pass names the run holds"
                )
            raise ValueError(
                f"no {signals} rows in {_where(source)}: replica drift reads the parameter "
                'signal; record it with inject_observer(..., signals=("output", '
                '"output_gradient", "parameter"), rank_policy="all")'
            )
        if len(run_ranks) < 2:
            raise ValueError(
                f"only rank {run_ranks[0]} wrote history in {_where(source)}: replica drift "
                'compares ranks; record every rank with inject_observer(..., rank_policy="all")'
            )
        yield parts, run_ranks


def _drift_table(frame: pl.DataFrame, run_ranks: list[int], only_drift: bool) -> pl.DataFrame:
    """:func:`replica_drift`'s rows of the forwards ``frame`` holds (every rank's rows of
    them), sorted."""
    rows = frame.select(
        *DRIFT_KEY,
        pl.col("rank").cast(pl.Int32),
        "run_id",
        pl.col("value").cast(pl.Float64),
    )
    _refuse_several_runs(rows)
    key = list(DRIFT_KEY)
    value = pl.col("value")
    rows = rows.with_columns(
        ((value == 0) & ((1.0 / value) < 0)).fill_null(False).alias("_negative_zero")
    )
    exact = ["value", "_negative_zero"]
    # The reference: the value most ranks hold, a tie going to the one held by the lowest rank.
    holders = rows.group_by([*key, *exact]).agg(
        pl.len().alias("_holders"), pl.col("rank").min().alias("_lowest")
    )
    reference = (
        holders.sort([*key, "_holders", "_lowest"], descending=[*(False,) * len(key), True, False])
        .unique(subset=key, keep="first", maintain_order=True)
        .select(*key, pl.col("value").alias("reference"), pl.col("_negative_zero").alias("_ref_nz"))
    )
    rows = rows.join(reference, on=key, how="left")
    same = pl.col("value").eq_missing(pl.col("reference")) & (
        pl.col("_negative_zero") == pl.col("_ref_nz")
    )
    finite = value.is_not_null() & value.is_finite()
    table = rows.group_by(key).agg(
        pl.len().cast(pl.Int64).alias("n_ranks"),
        pl.col("rank").filter(~same).sort().alias("_differing"),
        pl.col("reference").first(),
        value.filter(finite).min().alias("min"),
        value.filter(finite).max().alias("max"),
        pl.col("rank").sort().alias("ranks"),
        value.sort_by("rank").alias("values"),
    )
    everyone = pl.lit(pl.Series("run_ranks", [run_ranks], dtype=pl.List(pl.Int32)))
    table = table.with_columns(everyone.list.set_difference(pl.col("ranks")).alias("missing_ranks"))
    compared = pl.col("missing_ranks").list.len() == 0
    table = table.with_columns(
        pl.when(compared).then(pl.col("_differing").list.len() == 0).alias("agree"),
        pl.when(compared).then(pl.col("_differing")).alias("differing_ranks"),
        pl.col("missing_ranks").list.sort(),
        (pl.col("max") - pl.col("min")).alias("spread"),
    )
    if only_drift:
        table = table.filter(pl.col("agree").not_())
    return plain(table.select(DRIFT_COLUMNS)).sort(key)


def drift_tables(
    source: PathOrFrame,
    *,
    signal: Signal | Sequence[Signal] = "parameter",
    layer: str | Sequence[str] | None = None,
    metric: str | Sequence[str] | None = None,
    only_drift: bool = False,
    progress: ProgressCallback | None = None,
) -> Iterator[pl.DataFrame]:
    """:func:`replica_drift`'s table a range of forwards at a time, in forward order (their
    concatenation is the whole table): what a reader of a long all-ranks run iterates instead
    of holding the table. Same arguments and errors as :func:`replica_drift`, raised before
    the first piece."""
    signals = signal_names(signal, PARAMETER_SIGNALS) or ["parameter"]
    with _partitions(source, signals, names(layer, "layer"), names(metric, "metric")) as (
        parts,
        run_ranks,
    ):
        pieces = parts.frames()
        yield from (_drift_table(frame, run_ranks, only_drift) for frame in pieces)


def replica_drift(
    source: PathOrFrame,
    *,
    signal: Signal | Sequence[Signal] = "parameter",
    layer: str | Sequence[str] | None = None,
    metric: str | Sequence[str] | None = None,
    only_drift: bool = False,
) -> pl.DataFrame:
    """Each parameter's statistics across ranks at each sampled step, and whether they agree.

    ``source`` is a run's ``output_dir`` (every rank's ``rank-NNN/``, read a range of forwards
    at a time: :class:`~ti_dist.partitions.RankPartitions`) or a frame of ``ti.history`` rows
    of every rank. ``signal`` is one or more of the parameter signals (``parameter``, the
    default; ``parameter_gradient`` and ``parameter_update`` agree under DDP too); ``layer``
    and ``metric`` select names.

    One row per ``forward_index``, ``signal``, ``layer``, ``tensor_path`` and ``metric``
    (sorted so), with: ``n_ranks`` (ranks holding the row); ``agree`` (every rank stored the
    same value, exactly: the rule in this module's docstring; null when some rank lacks the
    row); ``differing_ranks`` (ranks whose value is not ``reference``; null when not compared);
    ``missing_ranks`` (ranks of the run without this row); ``reference`` (the value most ranks
    hold; a tie: the value the lowest of them holds); ``min``, ``max``, ``spread`` (max - min)
    over the finite values; ``ranks`` and ``values`` (aligned lists, ordered by rank). The
    ranks of the run are every rank with rows in ``source``. ``only_drift=True`` keeps the rows
    whose ``agree`` is false. The table holds every rank's value of every row it lists: on a
    long run iterate :func:`drift_tables` (or pass ``only_drift=True``) instead.

    Raises ``ValueError`` when ``source`` holds no rows of ``signal`` (the parameter signals are
    opt-in: ``inject_observer(..., signals=(..., "parameter"))``), only one rank, or more than
    one run of a rank (filter by ``run_id``).
    """
    pieces = list(
        drift_tables(source, signal=signal, layer=layer, metric=metric, only_drift=only_drift)
    )
    return pl.concat(pieces) if len(pieces) > 1 else pieces[0]


def _is_drift_table(source: object) -> bool:
    return isinstance(source, pl.DataFrame) and set(DRIFT_COLUMNS) <= set(source.columns)


def first_drift(
    source: PathOrFrame,
    *,
    signal: Signal | Sequence[Signal] = "parameter",
    layer: str | Sequence[str] | None = None,
    metric: str | Sequence[str] | None = None,
) -> Drift | None:
    """The first sampled step and parameter where the ranks differ; None when every compared
    measurement agrees.

    ``source`` and the selection are those of :func:`replica_drift`; a table it returned is
    accepted too (the selection arguments are then ignored). "First" is the smallest
    ``forward_index``; within it, the signals in the contract's order, then ``layer`` and
    ``tensor_path`` as strings. Measurements some rank lacks are not compared (see
    :func:`replica_drift`'s ``missing_ranks``).
    """
    if _is_drift_table(source):
        assert isinstance(source, pl.DataFrame)
        return drift_in(source)
    for table in drift_tables(source, signal=signal, layer=layer, metric=metric):
        found = drift_in(table)  # forwards in order: the first piece with drift holds it
        if found is not None:
            return found
    return None


def drift_in(table: pl.DataFrame) -> Drift | None:
    """:func:`first_drift` of a :func:`replica_drift` table (or a piece of one that holds
    whole forwards: one of :func:`drift_tables`)."""
    order = pl.col("signal").replace_strict(
        {name: i for i, name in enumerate(PARAMETER_SIGNALS)}, default=len(PARAMETER_SIGNALS)
    )
    drifted = table.filter(pl.col("agree").not_()).sort(
        [pl.col("forward_index"), order, pl.col("layer"), pl.col("tensor_path")]
    )
    if not drifted.height:
        return None
    first = drifted.row(0, named=True)
    step = first["forward_index"]
    parameter = [first["signal"], first["layer"], first["tensor_path"]]
    here = table.filter(
        (pl.col("forward_index") == step)
        & (pl.col("signal") == parameter[0])
        & (pl.col("layer") == parameter[1])
        & (pl.col("tensor_path") == parameter[2])
    )
    profile = {name: i for i, name in enumerate(DEFAULT_METRICS)}
    metrics = sorted(
        here.iter_rows(named=True), key=lambda r: (profile.get(r["metric"], 1 << 30), r["metric"])
    )
    differing = sorted({r for ranks in here["differing_ranks"].drop_nulls() for r in ranks})
    values = {row["metric"]: dict(zip(row["ranks"], row["values"], strict=True)) for row in metrics}
    at_step = drifted.filter(pl.col("forward_index") == step)
    return Drift(
        forward_index=int(step),
        signal=str(parameter[0]),
        layer=str(parameter[1]),
        tensor_path=str(parameter[2]),
        ranks=tuple(int(r) for r in first["ranks"]),
        differing_ranks=tuple(int(r) for r in differing),
        differing_metrics=tuple(str(row["metric"]) for row in metrics if row["agree"] is False),
        metric_differing_ranks={
            row["metric"]: tuple(int(r) for r in row["differing_ranks"] or ()) for row in metrics
        },
        reference={row["metric"]: row["reference"] for row in metrics},
        values=values,
        parameters_differing=at_step.select("signal", "layer", "tensor_path").unique().height,
    )


__all__ = [
    "DRIFT_COLUMNS",
    "DRIFT_KEY",
    "Drift",
    "drift_in",
    "drift_tables",
    "first_drift",
    "replica_drift",
]
