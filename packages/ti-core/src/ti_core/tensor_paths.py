"""Where the tensors of a module's output are: the ``tensor_path`` of each (docs/capture.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Final

import torch

_MAX_DEPTH: Final = 32
"""Nesting deeper than this is not walked."""


def tensor_leaves(output: object) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in ``output`` with its ``tensor_path``, in traversal order.

    The path is the Python accessor suffix that reaches the tensor: ``""`` for a bare tensor,
    ``[0]`` for sequence items, ``['logits']`` for mapping keys (``repr`` of the key), ``.name``
    for dataclass and namedtuple fields, nested by concatenation (``[1]['h'].state``).
    Non-tensor leaves are skipped. Mappings win over dataclasses (e.g. HF ``ModelOutput``).
    """
    if isinstance(output, torch.Tensor):
        return [("", output)]
    found: list[tuple[str, torch.Tensor]] = []
    _walk(output, "", found, 0, set())
    return found


def _walk(
    obj: object, path: str, out: list[tuple[str, torch.Tensor]], depth: int, seen: set[int]
) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
        return
    if depth >= _MAX_DEPTH or obj is None or isinstance(obj, str | bytes | int | float | bool):
        return
    key = id(obj)
    if key in seen:
        return
    seen.add(key)
    try:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                _walk(v, f"{path}[{k!r}]", out, depth + 1, seen)
        elif isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
            fields: tuple[str, ...] = type(obj)._fields  # type: ignore[attr-defined]
            for name, v in zip(fields, obj, strict=False):
                _walk(v, f"{path}.{name}", out, depth + 1, seen)
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj):
                _walk(v, f"{path}[{i}]", out, depth + 1, seen)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                _walk(getattr(obj, f.name, None), f"{path}.{f.name}", out, depth + 1, seen)
    finally:
        seen.discard(key)


__all__ = ["tensor_leaves"]
