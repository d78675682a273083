"""Writing the contract with engines other than pyarrow (Polars), without importing them.

Polars keeps neither Arrow nullability nor schema metadata on its own: ``df.write_parquet(path)``
marks every column nullable and drops the ``ti`` key. Given ``arrow_schema=`` it keeps field
nullability and field docs (but not schema metadata), and given ``metadata=`` it writes the
``ti`` key into the Parquet footer. :func:`polars_write_options` returns both.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa


def large_types(schema: pa.Schema) -> pa.Schema:
    """``schema`` with string -> large_string and list -> large_list: the types Polars writes.

    Names, nullability and field and schema metadata are kept; the contract accepts both forms.
    """

    def widen(typ: pa.DataType) -> pa.DataType:
        if pa.types.is_string(typ):
            return pa.large_string()
        if pa.types.is_list(typ):
            return pa.large_list(typ.value_field.with_type(widen(typ.value_type)))
        return typ

    return pa.schema([f.with_type(widen(f.type)) for f in schema], metadata=schema.metadata)


def footer_metadata(schema: pa.Schema) -> dict[str, str]:
    """The schema metadata as ``str -> str``, the form Polars' ``metadata=`` option takes."""
    return {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}


def polars_write_options(schema: pa.Schema) -> dict[str, Any]:
    """Keyword arguments that make Polars write a conforming Parquet file.

    ``frame.write_parquet(path, **polars_write_options(history_schema(producer)))`` (also for
    ``LazyFrame.sink_parquet``). Readers then find ``ti`` in the Parquet footer
    (``pyarrow.parquet.read_metadata(path).metadata``), not in ``pq.read_schema(path).metadata``.
    """
    return {"arrow_schema": large_types(schema), "metadata": footer_metadata(schema)}
