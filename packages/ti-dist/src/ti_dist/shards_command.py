"""``ti shards RUN_DIR``: the whole-tensor statistics of an all-ranks run's sharded tensors.

ti-dist adds this command to ti-io's ``ti`` through the ``ti.commands`` entry-point group, as
``ti drift``. The reading is :func:`ti_dist.combine_shards`; this prints, per sharded tensor
(a parameter, or a tensor- or sequence-parallel output or output gradient), its combined
values at the latest sample every rank of its mesh holds.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import polars as pl

    from ti_io.cli.options import Commands

DESCRIPTION: Final[str] = """\
Combine the parts each rank measured of every sharded tensor of an all-ranks run (its
rank-NNN/ folders): FSDP2 parameters (tensor_path weight@S(0)) and tensor- or sequence-parallel
outputs and output gradients (@S(1), or @S(1)#0,1 on a submesh, combined over its ranks only).
Prints, per tensor, the whole tensor's statistics at the latest sample where every rank of its
mesh has its part; quartiles are not combinable and left out. --json writes every sample."""
SHOWN: Final[tuple[str, ...]] = ("mean", "std", "min", "max", "nonfinite_fraction")
"""The metrics printed by default (each combines exactly)."""
COMBINED: Final[int] = 0
NOTHING: Final[int] = 2
EXIT_STATUS: Final[str] = """exit status:
  0  the sharded tensors were combined and printed
  2  nothing to combine: not a run, no sharded tensor, a damaged file; or a usage error"""


def add_parser(commands: Commands) -> None:
    """Register ``ti shards`` with the subparsers of ``ti``."""
    shards = commands.add_parser(
        "shards",
        help="sharded tensors (FSDP2, tensor/sequence parallel) combined across ranks (ti-dist)",
        description=DESCRIPTION,
        epilog=EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    shards.add_argument(
        "run_dir", metavar="RUN_DIR", help="the run's output_dir (rank-NNN/ inside)"
    )
    shards.add_argument("--layer", action="append", help="only this layer (repeatable)")
    shards.add_argument(
        "--metric",
        action="append",
        help=f"a metric to print (repeatable; default: {', '.join(SHOWN)})",
    )
    shards.add_argument(
        "--json",
        action="store_true",
        help="write the whole combine_shards table (every sample) as a JSON array of objects",
    )
    shards.set_defaults(run=run, paths=("run_dir",))


def _latest(table: pl.DataFrame, metrics: list[str]) -> pl.DataFrame:
    """One row per tensor: its combined ``metrics`` at the latest sample combined."""
    import polars as pl

    key = ["layer", "call_index", "signal", "tensor_path"]
    whole = table.filter(pl.col("metric").is_in(metrics))
    complete = whole.filter(
        pl.col("unavailable_reason").is_null()
        | ~pl.col("unavailable_reason").str.starts_with("not combinable: the shards of ranks")
    )
    latest = complete.group_by(key).agg(pl.col("sample_id").max())
    rows = complete.join(latest, on=[*key, "sample_id"])
    wide = rows.pivot("metric", index=[*key, "sample_id", "shape", "ranks"], values="value")
    present = [m for m in metrics if m in wide.columns]
    return wide.select(*key, "sample_id", "shape", "ranks", *present).sort(key)


def run(args: argparse.Namespace) -> int:
    import polars as pl

    from ti_dist.shards import combine_shards
    from ti_io.cli.output import write_machine_pieces
    from ti_io.read.legacy_layout import check_not_legacy

    try:
        check_not_legacy(args.run_dir, "combined across ranks")
        table = combine_shards(args.run_dir)
    except (OSError, ValueError) as exc:  # not a run, damaged, a profile without weights
        print(f"ti shards: {exc}", file=sys.stderr)
        return NOTHING
    if args.layer:
        table = table.filter(pl.col("layer").is_in(args.layer))
    if table.is_empty():
        print(
            f"ti shards: no sharded tensor in {args.run_dir!r}"
            + (f" for layer(s) {args.layer}" if args.layer else "")
            + " (sharded rows have a tensor_path ending in @S(d); record every rank: "
            'rank_policy="all")',
            file=sys.stderr,
        )
        return NOTHING
    if args.json:
        write_machine_pieces(iter([table]), "json")
        return COMBINED
    metrics = args.metric or list(SHOWN)
    unknown = sorted(set(metrics) - set(table["metric"].unique()))
    if unknown:
        print(
            f"ti shards: unknown metric(s) {unknown}; the run holds "
            f"{sorted(table['metric'].unique())}",
            file=sys.stderr,
        )
        return NOTHING
    latest = _latest(table, metrics)
    print(
        f"ti shards: {latest.height} sharded tensors of {args.run_dir}, whole-tensor values at "
        "the latest sample combined"
    )
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, fmt_str_lengths=60):
        print(latest)
    return COMBINED
