"""Which modules are observed, under which names, and which of them get histograms."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ti_core import _torch
from ti_core.compiled.traced import CUDA_GRAPHS_REFUSED, cuda_graphs_requested
from ti_core.sink import LayerInfo

Selector = Callable[[str, nn.Module], bool]
"""Any ``(qualified_name, module) -> bool``; ``''`` is the root."""


class _LeafModules:
    def __call__(self, name: str, module: nn.Module) -> bool:
        return next(iter(module.children()), None) is None

    def __repr__(self) -> str:
        return "leaf_modules()"


def leaf_modules() -> Selector:
    """The default selector: modules without child modules."""
    return _LeafModules()


@dataclass(frozen=True)
class Selection:
    """Selected modules in traversal order, their names and the histogram focus subset."""

    modules: tuple[nn.Module, ...]
    layers: tuple[LayerInfo, ...]
    focus: tuple[int, ...]
    """Indices into ``layers`` of the focus layers."""


def _data_parallel_types() -> tuple[type[nn.Module], ...]:
    found: list[type[nn.Module]] = [nn.DataParallel]
    if torch.distributed.is_available():
        from torch.nn.parallel import DistributedDataParallel

        found.append(DistributedDataParallel)
    return tuple(found)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module whose names are reported: the model behind its wrappers.

    ``torch.compile``'s ``OptimizedModule`` (``_orig_mod``) and the data-parallel wrappers
    ``DistributedDataParallel`` and ``DataParallel`` (``module``) are peeled off in any nesting
    (DDP of a compiled model, a compiled DDP), so layer names equal the bare model's
    ``named_modules()``. FSDP2's ``fully_shard`` works in place and keeps the names; nothing to
    peel. Hooks still go on the outermost module, so one root forward is one call of it.
    """
    wrappers = _data_parallel_types()
    while True:
        inner = _torch.compiled_inner(model)
        if inner is not None:
            model = inner
            continue
        wrapped = getattr(model, "module", None)
        if isinstance(model, wrappers) and isinstance(wrapped, nn.Module):
            model = wrapped
            continue
        return model


def compiled_wrappers(model: nn.Module) -> list[nn.Module]:
    """The ``torch.compile`` ``OptimizedModule``s among ``model`` and the wrappers between it
    and the bare model (the same peeling as :func:`unwrap_model`), outermost first."""
    wrappers = _data_parallel_types()
    found: list[nn.Module] = []
    while True:
        inner = _torch.compiled_inner(model)
        if inner is not None:
            found.append(model)
            model = inner
            continue
        wrapped = getattr(model, "module", None)
        if isinstance(model, wrappers) and isinstance(wrapped, nn.Module):
            model = wrapped
            continue
        return found


def check_compiled_model(model: nn.Module) -> None:
    """Raise ValueError when ``model`` is (or wraps) a ``torch.compile``d module compiled for
    CUDA graphs (``mode="reduce-overhead"``, ``"max-autotune"``): refused at ``inject_observer``
    before anything is touched (a module compiled after it was observed is checked when it is
    first traced: :func:`ti_core.compiled.traced.cuda_graphs_requested`)."""
    for wrapper in compiled_wrappers(model):
        if cuda_graphs_requested(_torch.optimized_config(wrapper)):
            raise ValueError(f"model is compiled for CUDA graphs; {CUDA_GRAPHS_REFUSED}")


def select_modules(
    model: nn.Module,
    selector: Selector | None,
    histogram_selector: Selector | Collection[str] | None,
    max_histogram_modules: int,
) -> Selection:
    """Run the selectors over ``model.named_modules()``; raise ValueError when nothing matches.

    A module registered under several names is one layer: its first name in traversal order, the
    others in ``aliases``. It is selected when the selector accepts any of its names.
    """
    if selector is None:
        selector = leaf_modules()
    elif not callable(selector):
        raise TypeError(
            f"selector= must be a callable (name, module) -> bool such as leaf_modules(), "
            f"got {selector!r}"
        )
    names: dict[int, list[str]] = {}
    order: list[nn.Module] = []
    for name, module in model.named_modules(remove_duplicate=False):
        key = id(module)
        if key not in names:
            names[key] = []
            order.append(module)
        names[key].append(name)
    modules: list[nn.Module] = []
    layers: list[LayerInfo] = []
    for module in order:
        all_names = names[id(module)]
        if any(bool(selector(n, module)) for n in all_names):
            modules.append(module)
            layers.append(LayerInfo(all_names[0], type(module).__name__, tuple(all_names[1:])))
    if not modules:
        raise ValueError(
            f"selector={selector!r} matched no module of {type(model).__name__}; "
            "pass a selector that accepts at least one (name, module), e.g. leaf_modules()"
        )
    focus = _focus(layers, modules, histogram_selector, max_histogram_modules)
    return Selection(tuple(modules), tuple(layers), focus)


def _focus(
    layers: list[LayerInfo],
    modules: list[nn.Module],
    histogram_selector: Selector | Collection[str] | None,
    limit: int,
) -> tuple[int, ...]:
    if histogram_selector is None:
        return tuple(range(min(limit, len(layers))))
    if callable(histogram_selector):
        chosen = [
            i
            for i, (info, module) in enumerate(zip(layers, modules, strict=True))
            if any(bool(histogram_selector(n, module)) for n in (info.name, *info.aliases))
        ]
        if not chosen:
            raise ValueError(
                f"histogram_selector={histogram_selector!r} matched none of the "
                f"{len(layers)} selected modules; pass a selector that accepts one of them, a "
                "list of their names, or None for the first max_histogram_modules"
            )
        return tuple(chosen[:limit])
    if isinstance(histogram_selector, str) or not isinstance(histogram_selector, Iterable):
        raise TypeError(
            "histogram_selector= must be a callable (name, module) -> bool or a list of selected "
            f"module names, got {histogram_selector!r}"
        )
    wanted = list(histogram_selector)
    index = {n: i for i, info in enumerate(layers) for n in (info.name, *info.aliases)}
    unknown = [n for n in wanted if n not in index]
    if unknown or not wanted:
        raise ValueError(
            f"histogram_selector names {unknown or wanted!r} are not selected modules; "
            f"selected: {[info.name for info in layers][:20]!r}"
        )
    return tuple(sorted({index[n] for n in wanted}))[:limit]
