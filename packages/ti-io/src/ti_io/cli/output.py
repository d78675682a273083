"""How ``ti`` prints tables: for people (escaped names, one context column less when the run
has one) and for machines (``--csv``, strict ``--json``) on stdout."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from typing import Any, Final

import polars as pl

from ti_io.read.summary import display_name

TERMINAL_TABLE: Final[dict[str, Any]] = {
    "tbl_rows": -1,
    "tbl_cols": -1,
    "tbl_width_chars": 240,
    "fmt_str_lengths": 48,
    "tbl_hide_dataframe_shape": True,
    "tbl_hide_column_data_types": True,
    "float_precision": 6,
}
CONTEXT_COLUMNS: Final[tuple[str, ...]] = ("mode", "grad_enabled", "tensor_path")
"""Columns a terminal table leaves out when they hold one value for the whole table."""


def escaped(table: pl.DataFrame) -> pl.DataFrame:
    """``table`` with layer names and tensor paths safe to print (:func:`display_name`)."""
    return table.with_columns(
        pl.col("layer").map_elements(display_name, return_dtype=pl.String),
        pl.col("tensor_path").map_elements(
            lambda p: display_name(p) if p else "", return_dtype=pl.String
        ),
    )


def without_constant_context(table: pl.DataFrame) -> pl.DataFrame:
    """``table`` without the context columns that hold a single value (nothing to show)."""
    for column in CONTEXT_COLUMNS:
        if table.get_column(column).n_unique() <= 1:
            table = table.drop(column)
    return table


def write_machine(table: pl.DataFrame, fmt: str) -> None:
    """``table`` as CSV or strict JSON (an array of objects; NaN and infinity as null)."""
    write_machine_pieces([table], fmt)


def write_machine_pieces(pieces: Iterable[pl.DataFrame], fmt: str) -> None:
    """The concatenation of ``pieces`` (one schema) as :func:`write_machine` writes one table,
    a piece at a time: a long table is never held whole."""
    first = True
    for table in pieces:
        if fmt == "csv":
            sys.stdout.write(table.write_csv(include_header=first))
        else:
            rows = [{k: _strict(v) for k, v in row.items()} for row in table.iter_rows(named=True)]
            text = json.dumps(rows, ensure_ascii=False, allow_nan=False)[1:-1]
            if text:
                sys.stdout.write(("[" if first else ", ") + text)
            elif first:
                sys.stdout.write("[")
        first = False
    if fmt != "csv":
        sys.stdout.write(("[" if first else "") + "]\n")


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def print_table(table: pl.DataFrame) -> None:
    """``table`` for a terminal: every row and column, wide, without shape or types."""
    with pl.Config(**TERMINAL_TABLE):
        print(table)
