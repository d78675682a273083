"""A run's rows as one kind of frame: a LazyFrame whose string columns are plain strings.

Writers may dictionary-encode repeated strings (read back as Categorical); readers cast them to
plain strings so that frames of different writers concatenate, join and compare alike. Every
reader that takes "a run directory or a frame of ``ti.history`` rows" goes through
:func:`history_frame`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import polars as pl

from ti_schema import DICTIONARY_COLUMNS

PathOrFrame = str | os.PathLike[str] | pl.LazyFrame | pl.DataFrame
"""A run directory, or a frame of ``ti.history`` rows."""


def plain_strings(frame: pl.LazyFrame, *, check: bool = False) -> pl.LazyFrame:
    """``frame`` with the contract's dictionary-encodable columns cast to ``pl.String``.

    ``check=False`` (every ``ti.history`` frame has these columns) builds the cast without
    looking at the data; ``check=True`` casts only the columns the frame has (it resolves the
    schema, which reads a file footer).
    """
    names = sorted(DICTIONARY_COLUMNS)
    if check:
        present = set(frame.collect_schema().names())
        names = [name for name in names if name in present]
    return frame.with_columns(pl.col(name).cast(pl.String) for name in names)


def history_frame(
    source: PathOrFrame, scan: Callable[[str | os.PathLike[str]], pl.LazyFrame]
) -> pl.LazyFrame:
    """``source`` as a LazyFrame: a frame as it is (lazily), a path read with ``scan``.

    Raises ``TypeError`` for anything else, naming what is accepted.
    """
    if isinstance(source, pl.DataFrame):
        return source.lazy()
    if isinstance(source, pl.LazyFrame):
        return source
    if isinstance(source, str | os.PathLike):
        return scan(source)
    raise TypeError(
        "source must be an output_dir path or a polars LazyFrame/DataFrame of ti.history "
        f"rows, got {type(source).__name__}"
    )
