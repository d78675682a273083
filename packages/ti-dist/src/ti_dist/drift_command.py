"""``ti drift RUN_DIR``: the first sampled step and parameter where the replicas differ.

ti-dist adds this command to ti-io's ``ti`` through the ``ti.commands`` entry-point group
(``add_parser`` and ``run``, like ti-io's own command modules). The reading is
:func:`ti_dist.replica_drift` / :func:`ti_dist.first_drift`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Final

from ti_schema import PARAMETER_SIGNALS

if TYPE_CHECKING:
    import polars as pl

    from ti_dist.drift import Drift
    from ti_io.cli.options import Commands
    from ti_io.progress import ProgressCallback
    from ti_schema import Signal

DESCRIPTION: Final[str] = """\
Read the parameter signal of every rank of an all-ranks run (its rank-NNN/ folders) and print
the first sampled step (forward_index) and parameter where the ranks' statistics are not
bit-identical, with each rank's values, or that every parameter agrees at every step. Steps not
sampled on every rank are named, never compared. Record the run with
inject_observer(..., signals=(..., "parameter"), rank_policy="all") and a sampler that samples
the same forwards on every rank (EveryNForwardsSampler, AlwaysSampler)."""
LISTED_RANKS: Final[int] = 8
"""Past this many ranks a message counts them instead of listing them."""
AGREE: Final[int] = 0
DRIFT: Final[int] = 1
CANNOT_COMPARE: Final[int] = 2
EXIT_STATUS: Final[str] = """exit status:
  0  every rank holds the same value of every metric of every parameter at every step
     sampled on all ranks
  1  some rank differs (the first step and parameter are printed)
  2  nothing could be compared: not a run, no parameter rows, a single rank, no step sampled
     on every rank, a damaged file, a torchinstruments 0.8.0 run; or a usage error"""


def add_parser(commands: Commands) -> None:
    """Register ``ti drift`` with the subparsers of ``ti``."""
    drift = commands.add_parser(
        "drift",
        help="replica drift: the first step and parameter where ranks differ (ti-dist)",
        description=DESCRIPTION,
        epilog=EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    drift.add_argument("run_dir", metavar="RUN_DIR", help="the run's output_dir (rank-NNN/ inside)")
    drift.add_argument(
        "--signal",
        action="append",
        choices=PARAMETER_SIGNALS,
        help="the parameter signal to compare (repeatable; default: parameter)",
    )
    drift.add_argument(
        "--json",
        action="store_true",
        help="write the whole replica_drift table as a JSON array of objects to stdout, nothing "
        "else (the exit status is the same)",
    )
    from ti_io.cli.options import progress_flag

    progress_flag(drift)
    drift.set_defaults(run=run, paths=("run_dir",))


def _ranks(ranks: list[int] | tuple[int, ...]) -> str:
    return ", ".join(str(r) for r in ranks)


def _some_ranks(ranks: list[int] | tuple[int, ...]) -> str:
    """``rank 2``, ``ranks 1, 5``, or a count past :data:`LISTED_RANKS` ranks."""
    if len(ranks) > LISTED_RANKS:
        return f"{len(ranks)} ranks ({ranks[0]}, ..., {ranks[-1]})"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"


def _value(value: float | None) -> str:
    return "null" if value is None else repr(value)


def _report_drift(drift: Drift) -> None:
    same = [r for r in drift.ranks if r not in drift.differing_ranks]
    verb = "differs" if len(drift.differing_ranks) == 1 else "differ"
    print(
        f"replicas differ at forward_index {drift.forward_index}: parameter {drift.parameter} "
        f"(layer {drift.layer!r}, tensor_path {drift.tensor_path!r}, signal {drift.signal}): "
        f"{_some_ranks(drift.differing_ranks)} {verb} from {_some_ranks(same)} in "
        f"{len(drift.differing_metrics)} of {len(drift.values)} metrics"
    )
    if drift.parameters_differing > 1:
        print(f"{drift.parameters_differing} parameters differ at that step (this one first)")
    width = max(len(metric) for metric in drift.values)
    for metric, by_rank in drift.values.items():
        reference = drift.reference[metric]
        line = f"  {metric:<{width}}  "
        if metric not in drift.differing_metrics:
            print(f"{line}agrees   {_value(reference)}")
            continue
        apart = drift.metric_differing_ranks[metric]
        holders = [r for r in drift.ranks if r not in apart]
        others = "  ".join(f"rank {r}: {_value(by_rank[r])}" for r in apart[:LISTED_RANKS])
        more = f"  ... {len(apart) - LISTED_RANKS} ranks more" if len(apart) > LISTED_RANKS else ""
        print(f"{line}differs  {_value(reference)} ({_some_ranks(holders)})  {others}{more}")


class _Report:
    """What ``ti drift`` prints, gathered a piece of the replica-drift table at a time
    (:func:`ti_dist.drift_tables`: whole forwards each, in order), so a long run is never
    held whole."""

    def __init__(self) -> None:
        self.ranks: set[int] = set()
        self.partial: dict[int, set[int]] = {}
        """forward_index -> the ranks missing there (steps not sampled on every rank)."""
        self.steps = 0
        self.parameters: set[tuple[str, str, str]] = set()
        self.drift: Drift | None = None

    def add(self, table: pl.DataFrame) -> None:
        import polars as pl

        from ti_dist.drift import drift_in

        for column in ("ranks", "missing_ranks"):
            self.ranks.update(r for row in table[column] for r in row)
        partial = (
            table.filter(pl.col("agree").is_null())
            .group_by("forward_index")
            .agg(pl.col("missing_ranks").explode().drop_nulls().unique().sort())
        )
        for forward, missing in partial.iter_rows():
            self.partial.setdefault(int(forward), set()).update(missing)
        complete = table.filter(~pl.col("forward_index").is_in(list(self.partial)))
        self.steps += complete["forward_index"].n_unique()
        self.parameters.update(complete.select("signal", "layer", "tensor_path").unique().rows())
        if self.drift is None:
            self.drift = drift_in(table)

    def print(self, signals: Sequence[str]) -> int:
        ranks = sorted(self.ranks)
        print(
            f"ti drift: {len(ranks)} ranks ({_ranks(ranks)}); {self.steps} steps sampled on "
            f"every rank; signal {', '.join(signals)}"
        )
        if self.partial:
            steps = sorted(self.partial)
            named = "; ".join(
                f"forward_index {step} (missing ranks {_ranks(sorted(self.partial[step]))})"
                for step in steps[:5]
            )
            more = f" and {len(steps) - 5} more" if len(steps) > 5 else ""
            print(f"{len(steps)} steps not on every rank, not compared: {named}{more}")
        if self.drift is not None:
            _report_drift(self.drift)
            return DRIFT
        if not self.steps:
            print(
                "ti drift: no step was sampled on every rank, nothing to compare; sample the "
                "same forwards on every rank (EveryNForwardsSampler or AlwaysSampler)",
                file=sys.stderr,
            )
            return CANNOT_COMPARE
        print(
            f"all {len(ranks)} ranks agree exactly on all {len(self.parameters)} parameters at "
            f"all {self.steps} steps sampled on every rank"
        )
        return AGREE


def run(args: argparse.Namespace) -> int:
    from ti_io.progress import TerminalProgress

    signals = args.signal or ["parameter"]
    with TerminalProgress("drift", "rows", enabled=args.progress) as progress:
        return _run(args, signals, progress)


def _run(args: argparse.Namespace, signals: list[Signal], progress: ProgressCallback) -> int:
    from ti_dist.drift import drift_tables
    from ti_io.cli.output import write_machine_pieces
    from ti_io.read.legacy_layout import check_not_legacy

    try:
        check_not_legacy(args.run_dir, "compared across ranks")
        pieces = drift_tables(args.run_dir, signal=signals, progress=progress)
        if args.json:
            outcome = {"drift": False, "compared": False}

            def watched() -> Iterator[pl.DataFrame]:
                for table in pieces:
                    outcome["drift"] |= bool(table.filter(table["agree"].not_()).height)
                    outcome["compared"] |= bool(table["agree"].is_not_null().any())
                    yield table

            write_machine_pieces(watched(), "json")
            if outcome["drift"]:
                return DRIFT
            return AGREE if outcome["compared"] else CANNOT_COMPARE
        report = _Report()
        for table in pieces:
            report.add(table)
    except (OSError, ValueError) as exc:  # not a run, no parameter rows, one rank, damaged
        print(f"ti drift: {exc}", file=sys.stderr)
        return CANNOT_COMPARE
    return report.print(signals)
