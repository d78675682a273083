"""TensorBoard tags for arbitrary module names, escaped deterministically and reversibly.

A histogram's tag is ``{layer}/call{call_index}/{signal}{tensor_path}``, a scalar's the same
with ``/{metric}`` after it; a ``tensor_path`` that is a name
(a parameter's, ``weight``) is joined with a dot: ``fc/call0/parameter_update.weight``. Module
names are arbitrary strings
(``nn.ModuleDict`` keys may hold ``/``, ``..``, newlines, Markdown or HTML), so ``layer`` and
``tensor_path`` are escaped: ``%``, ``/``, ``\\``, whitespace, control and other non-printable
characters, and ``<>&"'`` followed by a backtick, become ``%XX`` (UTF-8 bytes, upper-case hex,
as in URLs); every other character stays. The root module (empty name) is written ``%root``,
which no escaped name can produce (``%`` is always followed by two hex digits there).
``urllib.parse.unquote`` reverses the escaping. The only ``/`` in a tag are the two separators,
so TensorBoard groups histograms by layer.
"""

from __future__ import annotations

import functools
from typing import Final

ROOT_TAG: Final[str] = "%root"
_ALWAYS: Final[frozenset[str]] = frozenset("%/\\<>&\"'`")


def _keep(char: str) -> bool:
    return char.isprintable() and not char.isspace() and char not in _ALWAYS


def escape_tag_part(text: str) -> str:
    """``text`` with every unsafe character percent-encoded (see the module docstring)."""
    if all(_keep(c) for c in text):
        return text
    return "".join(c if _keep(c) else "".join(f"%{b:02X}" for b in c.encode("utf-8")) for c in text)


@functools.lru_cache(maxsize=16384)
def scalar_tag(layer: str, call_index: int, signal: str, tensor_path: str, metric: str) -> str:
    """The TensorBoard tag of one metric of one measured tensor: its histogram's tag, ``/``
    and the metric (escaped as the other parts): ``fc/call0/output/std``."""
    return f"{histogram_tag(layer, call_index, signal, tensor_path)}/{escape_tag_part(metric)}"


@functools.lru_cache(maxsize=4096)
def histogram_tag(layer: str, call_index: int, signal: str, tensor_path: str) -> str:
    """The TensorBoard tag of one measured tensor (cached: the writer thread asks for the same
    focus layers' tags at every sample, and escaping is a Python pass per character)."""
    name = escape_tag_part(layer) if layer else ROOT_TAG
    path = escape_tag_part(tensor_path)
    if path and path[0] not in "[.":  # a parameter's name: ``parameter.weight``
        path = f".{path}"
    return f"{name}/call{call_index}/{escape_tag_part(signal)}{path}"
