"""torchinstruments 0.8.0's spelling of ``tensor_path``, in both directions (docs/migration.md).

Today a ``tensor_path`` is the accessor suffix that reaches a tensor in a module's output:
``''`` for the output itself, ``[0]`` for a sequence item, ``['aux']`` for a mapping key (the
key's ``repr``), ``.state`` for a field, nested by concatenation (``[1]['h'].state``). 0.8.0
wrote the output as ``output`` (``grad_output`` for its gradient) and each step as one dotted
segment: the index, the string key itself, the text of any other key, the field name
(``output.1.h.state``).

Both directions read through :class:`Step`: :func:`steps` parses today's spelling into steps,
each knowing its 0.8.0 segment; :func:`legacy_step` turns a 0.8.0 segment back into a step.
0.8.0 spelled an index, an integer key and the string key ``'0'`` alike, and a key holding a
dot as two segments, so :func:`modern_path` reads an integer segment as ``[N]`` and any other
as a string key: fields and non-string keys come back as string keys.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Final

OUTPUT_ROOT: Final[str] = "output"
"""0.8.0's path of a module's output itself (today ``''``)."""
GRADIENT_ROOT: Final[str] = "grad_output"
"""0.8.0's path of the gradient of a module's output itself (today ``''``)."""

_FIELD: Final[re.Pattern[str]] = re.compile(r"\.([^.\[]+)")
_INTEGER: Final[re.Pattern[str]] = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Step:
    """One step from a module's output towards one of its tensors."""

    spelling: str
    """As today's ``tensor_path`` writes it: ``[0]``, ``['aux']``, ``[(1, 2)]``, ``.state``."""
    segment: str
    """As 0.8.0 wrote it: ``0``, ``aux``, ``(1, 2)``, ``state``."""


def steps(tensor_path: str) -> tuple[Step, ...] | None:
    """The steps of today's ``tensor_path`` (``()`` for ``''``), or None when it is not an
    accessor suffix (a parameter's name, a DTensor placement suffix, a malformed key)."""
    found: list[Step] = []
    i = 0
    try:
        while i < len(tensor_path):
            if tensor_path[i] == ".":
                match = _FIELD.match(tensor_path, i)
                if match is None:
                    return None
                found.append(Step(match.group(0), match.group(1)))
                i = match.end()
            elif tensor_path[i] == "[":
                end = _closing_bracket(tensor_path, i)
                key = tensor_path[i + 1 : end]
                segment = str(ast.literal_eval(key)) if key[:1] in ("'", '"') else key
                found.append(Step(tensor_path[i : end + 1], segment))
                i = end + 1
            else:
                return None
    except (ValueError, SyntaxError):
        return None
    return tuple(found)


def legacy_step(segment: str) -> Step:
    """The step one dotted 0.8.0 segment stands for: an integer is an index (``[N]``), anything
    else a string key (``['key']``, as capture spells a mapping key: its ``repr``)."""
    spelling = f"[{int(segment)}]" if _INTEGER.fullmatch(segment) else f"[{segment!r}]"
    return Step(spelling, segment)


def legacy_path(tensor_path: str, *, gradient: bool) -> str:
    """Today's ``tensor_path`` in 0.8.0's spelling: ``''`` -> ``output``, ``[0]`` ->
    ``output.0``, ``['aux'][0]`` -> ``output.aux.0``, ``.field`` -> ``output.field``; gradients
    start with ``grad_output``. A path that is not an accessor suffix is appended as it is
    (``output.<path>``)."""
    root = GRADIENT_ROOT if gradient else OUTPUT_ROOT
    parsed = steps(tensor_path)
    if parsed is None:
        return f"{root}.{tensor_path}"
    return ".".join([root, *(step.segment for step in parsed)])


def modern_path(old: str) -> str:
    """0.8.0's ``tensor_path`` in today's spelling: ``output`` / ``grad_output`` -> ``''``;
    each further dotted segment ``[N]`` when it is an integer (a sequence index or an integer
    key), else ``['key']``. 0.8.0 wrote a string key ``'0'`` and a key holding a dot the same
    way as an index or two keys, so those cannot be told apart. A path under neither root is
    returned unchanged."""
    for root in (GRADIENT_ROOT, OUTPUT_ROOT):
        if old == root:
            return ""
        if old.startswith(root + "."):
            segments = old[len(root) + 1 :].split(".")
            return "".join(legacy_step(segment).spelling for segment in segments)
    return old


def _closing_bracket(text: str, start: int) -> int:
    """Index of the ``]`` that closes the ``[`` at ``start`` (a quoted key may hold ``]``);
    ValueError when there is none."""
    i = start + 1
    quote = text[i] if i < len(text) and text[i] in "'\"" else None
    if quote is None:
        return text.index("]", i)
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == quote:
            if i + 1 < len(text) and text[i + 1] == "]":
                return i + 1
            raise ValueError(text)
        i += 1
    raise ValueError(text)


__all__ = [
    "GRADIENT_ROOT",
    "OUTPUT_ROOT",
    "Step",
    "legacy_path",
    "legacy_step",
    "modern_path",
    "steps",
]
