"""Capture machinery: output pytrees, snapshots for batched reduction, and the hook objects.

Lifecycle: the observer owns two permanent hooks on the root module. Per-module hooks (or, with
``capture_direct_forwards``, instance-level ``forward`` overrides) exist only while sampling.
Gradient hooks live on the autograd graph (the output's ``grad_fn``) and die with it; they hold
a :class:`GradientState` and only a weak reference to the observer, so a forward whose backward
never comes leaks nothing once its graph is freed.

Every hook object pickles and deep-copies to an inert no-op, so ``copy.deepcopy(model)`` and
``torch.save(model)`` give unobserved copies that still run.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import torch
from torch import nn

from ti_core.context import dtype_name, now_us
from ti_core.records import Entry
from ti_core.snapshots import SnapshotPool

if TYPE_CHECKING:
    from ti_core.histograms import HistogramData
    from ti_core.observer import Observer
    from ti_core.reducers import ReductionPlan

SNAPSHOT_BUDGET_BYTES: Final[int] = 64 * 2**20
"""Tensors are cloned for a batched reduction until a batch holds this much; beyond it, pending
tensors are reduced at once (a bigger tensor is reduced in place, without a copy)."""
HISTOGRAM_BINS: Final[int] = 30
_MAX_DEPTH: Final[int] = 32


# ----------------------------------------------------------------------------- output pytrees


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


# ----------------------------------------------------------------------------- batched reduction


@dataclass
class Reduced:
    """Measurements of a batch of entries, aligned with ``entries``."""

    entries: list[Entry]
    values: np.ndarray
    available: np.ndarray
    reasons: list[list[str | None]]
    errors: list[BaseException]
    histogram_entries: list[Entry] = field(default_factory=list)
    histograms: list[HistogramData] = field(default_factory=list)


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return int(tensor._version)
    except RuntimeError:  # inference tensors have no version counter
        return None


class TensorBatch:
    """Collects one sample's tensors of one signal and reduces them in as few calls as possible.

    Snapshots (``detach().clone()``) are taken at the module boundary so later in-place ops
    cannot change what is measured; a tensor that does not fit the budget is reduced at once.
    The same tensor object seen again unchanged (same version: e.g. through ``nn.Identity``
    chains or a parent returning its child's output) is measured once and its row repeated.
    """

    def __init__(
        self,
        plan: ReductionPlan,
        focus: frozenset[int],
        bins: int = HISTOGRAM_BINS,
        pool: SnapshotPool | None = None,
    ):
        self._plan = plan
        # Recycled snapshot buffers, only when no user code (a custom reducer) sees them.
        self._pool = pool if plan.default_only else None
        self._pooled: list[torch.Tensor] = []
        self._focus = focus
        self._bins = bins
        self._n_metrics = len(plan.metric_names)
        self.entries: list[Entry] = []
        self._slot_of: list[int] = []
        self._slot_focus: list[bool] = []
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}
        self._pending: list[torch.Tensor] = []
        self._pending_slots: list[int] = []
        self._bytes = 0
        self._values: list[np.ndarray] = []
        self._available: list[np.ndarray] = []
        self._reasons: list[list[str | None]] = []
        self._reduced_slots: list[int] = []
        self._errors: list[BaseException] = []
        self._hist: dict[int, HistogramData] = {}
        self.host_only = True
        """Every tensor added so far lives in host memory (the emission worker may reduce it)."""

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def pending_bytes(self) -> int:
        """Bytes of the snapshots waiting for :meth:`finish`."""
        return self._bytes

    def add(self, entry: Entry, tensor: torch.Tensor) -> None:
        key = id(tensor)
        version = _version(tensor)
        seen = self._seen.get(key)
        focus = entry.layer in self._focus
        if seen is not None and version is not None and seen[1] == version and seen[0]() is tensor:
            slot = seen[2]
            if focus:
                self._slot_focus[slot] = True
        else:
            t = tensor.detach()
            if t.device.type != "cpu":
                self.host_only = False
            nbytes = t.numel() * t.element_size()
            fits = self._bytes + nbytes <= SNAPSHOT_BUDGET_BYTES
            if not fits:
                snap = t
            elif self._pool is not None and SnapshotPool.poolable(t):
                snap = self._pool.copy(t)
                self._pooled.append(snap)
            else:
                snap = t.clone()
            slot = len(self._slot_focus)
            self._slot_focus.append(focus)
            if version is not None:
                self._seen[key] = (weakref.ref(tensor), version, slot)
            self._pending.append(snap)
            self._pending_slots.append(slot)
            if fits:
                self._bytes += nbytes
            else:
                self._reduce_pending()
        self.entries.append(entry)
        self._slot_of.append(slot)

    def _reduce_pending(self) -> None:
        if not self._pending:
            return
        tensors, slots = self._pending, self._pending_slots
        self._pending, self._pending_slots, self._bytes = [], [], 0
        n, m = len(tensors), self._n_metrics
        try:
            got = self._plan.reduce(tensors)
            values = np.asarray(got.values, dtype=np.float64).reshape(n, m)
            available = np.asarray(got.available, dtype=np.bool_).reshape(n, m)
            reasons = [list(r) for r in got.reasons]
            self._errors.extend(got.errors)
            ordered = got.ordered
        except Exception as error:  # reducers promise not to raise; keep the rows if they do
            values = np.full((n, m), np.nan)
            available = np.zeros((n, m), dtype=np.bool_)
            reason = f"reduction failed: {type(error).__name__}: {error}"
            reasons = [[reason] * m for _ in range(n)]
            ordered = {}
            self._errors.append(error)
        self._values.append(values)
        self._available.append(available)
        self._reasons.extend(reasons)
        self._reduced_slots.extend(slots)
        focus = [
            (s, t, ordered.get(k))
            for k, (s, t) in enumerate(zip(slots, tensors, strict=True))
            if self._slot_focus[s]
        ]
        if focus:
            try:
                from ti_core.histograms import compute_histograms

                hists = compute_histograms(
                    [t for _, t, _ in focus], bins=self._bins, ordered=[o for _, _, o in focus]
                )
                self._hist.update((s, h) for (s, _, _), h in zip(focus, hists, strict=True))
            except Exception as error:
                self._errors.append(error)
        if self._pool is not None and self._pooled:
            # every pooled snapshot was pending, and is now reduced: nothing reads it again
            self._pool.recycle(self._pooled)
            self._pooled = []

    def finish(self) -> Reduced:
        """Reduce what is pending and return every measurement in entry order."""
        self._reduce_pending()
        self._seen.clear()
        m = self._n_metrics
        if not self.entries:
            return Reduced([], np.empty((0, m)), np.empty((0, m), np.bool_), [], self._errors)
        row_of_slot = np.empty(len(self._slot_focus), dtype=np.int64)
        row_of_slot[np.asarray(self._reduced_slots, dtype=np.int64)] = np.arange(
            len(self._reduced_slots)
        )
        rows = row_of_slot[np.asarray(self._slot_of, dtype=np.int64)]
        values = np.concatenate(self._values)[rows]
        available = np.concatenate(self._available)[rows]
        reasons = [self._reasons[i] for i in rows.tolist()]
        hist_entries: list[Entry] = []
        histograms: list[HistogramData] = []
        if self._hist:
            for entry, slot in zip(self.entries, self._slot_of, strict=True):
                hist = self._hist.get(slot)
                if hist is not None and entry.layer in self._focus:
                    hist_entries.append(entry)
                    histograms.append(hist)
        return Reduced(
            self.entries, values, available, reasons, self._errors, hist_entries, histograms
        )


# ----------------------------------------------------------------------------- hook objects


_HOOK_DICTS: Final[tuple[str, ...]] = ("_forward_pre_hooks", "_forward_hooks")
_HOOK_ID_SETS: Final[tuple[str, ...]] = (
    "_forward_hooks_always_called",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
)


def _inert(*args: object, **kwargs: object) -> None:
    """What a copied hook becomes: returns None, and on a module call removes its kind."""
    if args and isinstance(args[0], nn.Module):
        scrub_copied_hooks(args[0])


def _inert_factory() -> Callable[..., None]:
    return _inert


class PassthroughForward:
    """What a copied :class:`ForwardOverride` becomes: the class ``forward`` of its module."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.module).forward(self.module, *args, **kwargs)


def _copied_forward(module: nn.Module, previous: Callable[..., Any] | None) -> Callable[..., Any]:
    return previous if previous is not None else PassthroughForward(module)


def scrub_copied_hooks(module: nn.Module) -> None:
    """Remove what a copy of an observed module inherited (inert hooks, passthrough forward)."""
    for dict_name in _HOOK_DICTS:
        hooks = module.__dict__.get(dict_name)
        if not hooks:
            continue
        for key in [k for k, v in hooks.items() if v is _inert]:
            del hooks[key]
            for set_name in _HOOK_ID_SETS:
                ids = module.__dict__.get(set_name)
                if isinstance(ids, dict):
                    ids.pop(key, None)
    if isinstance(module.__dict__.get("forward"), PassthroughForward):
        del module.__dict__["forward"]


class _Hook:
    """Base of every hook object: copies and pickles become :func:`_inert`."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_inert_factory, ())


def _root_enter(observer: Observer) -> None:
    observer.root_enter()


def _root_exit(observer: Observer, module: nn.Module, output: Any) -> None:
    observer.root_exit(module, output)


def _capture(observer: Observer, layer: int, module: nn.Module, output: Any) -> None:
    observer.capture(layer, module, output)


# Under torch.compile the hooks run eagerly (a graph break) instead of being traced; in eager
# mode the undecorated functions are called, so unsampled forwards pay no wrapper cost.
_root_enter_eager = torch.compiler.disable(_root_enter)  # type: ignore[no-untyped-call]
_root_exit_eager = torch.compiler.disable(_root_exit)  # type: ignore[no-untyped-call]
_capture_eager = torch.compiler.disable(_capture)  # type: ignore[no-untyped-call]


class RootPreHook(_Hook):
    __slots__ = ("observer",)

    def __init__(self, observer: Observer) -> None:
        self.observer = observer

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            _root_enter_eager(self.observer)
        else:
            self.observer.root_enter(sys._getframe(1))


class RootPostHook(_Hook):
    __slots__ = ("observer",)

    def __init__(self, observer: Observer) -> None:
        self.observer = observer

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            _root_exit_eager(self.observer, module, output)
        else:
            self.observer.root_exit(module, output)


class CallHook(_Hook):
    """Forward hook on a selected module, installed only while sampling."""

    __slots__ = ("layer", "observer")

    def __init__(self, observer: Observer, layer: int) -> None:
        self.observer = observer
        self.layer = layer

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            _capture_eager(self.observer, self.layer, module, output)
        else:
            self.observer.capture(self.layer, module, output)


class ForwardOverride(_Hook):
    """Instance-level ``forward`` that captures direct ``module.forward(...)`` calls too.

    It replaces the forward hook of its module (calls through ``__call__`` also reach it), so no
    call is counted twice. ``previous`` is the instance ``forward`` the user had set, if any.
    """

    __slots__ = ("__weakref__", "layer", "module_ref", "observer", "previous")

    def __init__(
        self, observer: Observer, layer: int, module: nn.Module, previous: Callable[..., Any] | None
    ) -> None:
        self.observer = observer
        self.layer = layer
        self.module_ref = weakref.ref(module)
        self.previous = previous

    @property
    def __wrapped__(self) -> Callable[..., Any] | None:
        """What ``inspect.signature`` should see: the forward this override delegates to."""
        if self.previous is not None:
            return self.previous
        module = self.module_ref()
        return None if module is None else type(module).forward.__get__(module)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_copied_forward, (self.module_ref(), self.previous))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module_ref()
        if self.previous is not None:
            output = self.previous(*args, **kwargs)
        elif module is not None:
            output = type(module).forward(module, *args, **kwargs)
        else:  # pragma: no cover - the module owns this object through its __dict__
            raise ReferenceError("module of this forward override is gone")
        if module is not None:
            if torch.compiler.is_compiling():
                _capture_eager(self.observer, self.layer, module, output)
            else:
                self.observer.capture(self.layer, module, output)
        return output


# ----------------------------------------------------------------------------- gradients


class GradientState:
    """Gradient side of one sample: shared by its gradient hooks, owned by the autograd graph.

    Each output tensor's gradient is recorded the first time a backward reaches it; the rows of
    one backward are emitted when that backward ends (an autograd engine callback). The same
    unchanged tensor output by several calls gets one hook serving all of their entries.
    """

    __slots__ = (
        "batch",
        "entries",
        "forward_index",
        "hooked",
        "lock",
        "observer_ref",
        "queued",
        "recorded",
        "sample_id",
    )

    def __init__(self, observer: Observer, sample_id: int, forward_index: int) -> None:
        self.observer_ref: weakref.ref[Observer] = weakref.ref(observer)
        self.sample_id = sample_id
        self.forward_index = forward_index
        self.entries: list[Entry] = []
        self.recorded: set[int] = set()
        self.batch: TensorBatch | None = None
        self.queued = False
        self.lock = threading.Lock()
        self.hooked: dict[int, tuple[weakref.ref[torch.Tensor], int | None, GradHook]] = {}

    def watch(self, entry: Entry, tensor: torch.Tensor) -> None:
        """Register the gradient hook of ``tensor`` (a non-leaf that requires grad)."""
        index = len(self.entries)
        self.entries.append(entry)
        version = _version(tensor)
        seen = self.hooked.get(id(tensor))
        if seen is not None and seen[1] == version and seen[0]() is tensor:
            seen[2].indices.append(index)
            return
        hook = GradHook(self, index)
        tensor.register_hook(hook)  # type: ignore[no-untyped-call]
        self.hooked[id(tensor)] = (weakref.ref(tensor), version, hook)

    def forward_done(self) -> None:
        """The sampled forward returned: no more hooks will be registered."""
        self.hooked = {}

    def receive(self, indices: list[int], grad: torch.Tensor) -> None:
        observer = self.observer_ref()
        if observer is None or observer.closed:
            return
        try:
            with self.lock:
                stamp = now_us()
                shape = tuple(grad.shape)
                dtype = dtype_name(grad.dtype)
                for index in indices:
                    if index in self.recorded:
                        continue
                    self.recorded.add(index)
                    fwd = self.entries[index]
                    entry = Entry(
                        fwd.layer,
                        fwd.call_index,
                        fwd.path,
                        fwd.train,
                        fwd.grad_enabled,
                        shape,
                        dtype,
                        stamp,
                    )
                    if self.batch is None:
                        self.batch = observer.new_batch()
                    self.batch.add(entry, grad)
                    if not self.queued:
                        torch.autograd.Variable._execution_engine.queue_callback(self.flush)
                        self.queued = True
        except Exception as error:
            observer.errors.handle("gradient capture", error)

    def flush(self) -> None:
        """End of a backward: emit the gradients it delivered to this sample."""
        with self.lock:
            batch, self.batch, self.queued = self.batch, None, False
        observer = self.observer_ref()
        if observer is None or observer.closed or batch is None:
            return
        observer.finish_gradients(self, batch)


class GradHook(_Hook):
    """Tensor hook bound to (sample, call, tensor_path) entries; never changes the gradient."""

    __slots__ = ("indices", "state")

    def __init__(self, state: GradientState, index: int) -> None:
        self.state = state
        self.indices = [index]

    def __call__(self, grad: torch.Tensor | None) -> None:
        if grad is not None:
            self.state.receive(self.indices, grad)


def install_forward_override(
    observer: Observer, layer: int, module: nn.Module
) -> Callable[[], None]:
    """Put a :class:`ForwardOverride` on ``module``; return the function that undoes it exactly."""
    had_instance = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    override = ForwardOverride(observer, layer, module, previous)
    module.__dict__["forward"] = override
    module_ref = weakref.ref(module)

    def restore() -> None:
        target = module_ref()
        if target is None or target.__dict__.get("forward") is not override:
            return
        if had_instance:
            target.__dict__["forward"] = previous
        else:
            del target.__dict__["forward"]

    return restore
