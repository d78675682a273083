"""Markdown that no run's text can break: the building blocks of index.md.

Module names are arbitrary strings (``/``, ``..``, newlines, Markdown, HTML). They never appear
in Markdown prose: only inside fenced code blocks, and there as JSON string literals with
non-ASCII and ``<>&`` escaped (:func:`literal`), which are also valid Python literals. A
literal never contains a newline or starts a line, so it cannot close a fence or inject
markup. Other variable text in prose goes through :func:`md_escape`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Final

_MD_SPECIAL: Final[re.Pattern[str]] = re.compile(
    r"([\\`*\[\]<>|~&]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))"
)


def md_escape(text: str) -> str:
    """``text`` safe inside a Markdown table cell: one line; characters that could start
    markup there (code, emphasis, links, HTML, entities, cell breaks) backslash-escaped."""
    return _MD_SPECIAL.sub(r"\\\1", " ".join(text.splitlines()))


def literal(text: str) -> str:
    """A one-line JSON (and Python) string literal of ``text``: ASCII only, and ``<``, ``>``,
    ``&`` escaped too, so no HTML survives even where the Markdown is not rendered as such."""
    return (
        json.dumps(text, ensure_ascii=True)
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
    )


def fence(lines: Sequence[str], info: str = "text") -> list[str]:
    return [f"```{info}", *lines, "```", ""]


def columns_table(schema_name: str, schema: object) -> list[str]:
    import pyarrow as pa

    assert isinstance(schema, pa.Schema)
    out = [
        f"Columns of `{schema_name}`:",
        "",
        "| column | Arrow type | nullable | meaning |",
        "|---|---|---|---|",
    ]
    for f in schema:
        doc = (f.metadata or {}).get(b"doc", b"").decode()
        out.append(
            f"| `{f.name}` | `{f.type}` | {'yes' if f.nullable else 'no'} | {md_escape(doc)} |"
        )
    return [*out, ""]


__all__ = ["columns_table", "fence", "literal", "md_escape"]
