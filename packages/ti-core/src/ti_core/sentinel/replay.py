"""The flight recorder's replay: re-run a step whose result was not finite, with checks on
every selected module, to name the module and to tell real numerics from a faulty device.

The sentinel's replay mode checks only the root's outputs (per root forward) and the gradients
of the selected modules' parameters (per backward). When one fires, this module re-runs the
step the way it ran:

- the arguments of that root forward (:class:`StepRecord`, kept for the latest root forward
  only: references, no copies; a tensor argument changed in place since, detected by its
  version counter, makes the step not replayable), its random number generator states (CPU and
  each CUDA device), its grad mode and autocast state;
- the module's buffers are saved before and restored after (BatchNorm's running statistics end
  as if no replay had happened), the RNG states the training will use next too; nothing is
  accumulated into ``.grad`` (the replayed backward is ``torch.autograd.grad``) and no
  optimizer is touched;
- the eager module is run (``torch.compile``'s ``_orig_mod``, DDP's ``module``: no collective,
  nothing compiled), with a temporary pre-hook and hook on every selected module that check
  what it received (its tensor inputs and its parameters) and what it made (its outputs; in a
  replayed backward the gradient flowing into each output, in arrival order).

The first finding names the event's module: a module whose own output (or the gradient into
its output) is the first non-finite value, or the root when the value came with the inputs (the
batch, or code outside the selection). The verdict (:class:`Verdict`): ``reproduced`` (real
numerics), ``not_reproduced`` (the replay is clean: a transient fault of the device or a
non-deterministic kernel), ``from_another_rank`` (a backward whose gradients are reduced across
ranks, with this rank's own replay clean) or ``not_replayable``.
"""

from __future__ import annotations

import collections.abc
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import Tensor, nn

from ti_core import _torch
from ti_core.sentinel import replay_context
from ti_core.sentinel.flags import real_values
from ti_core.tensor_paths import tensor_leaves
from ti_schema import ReplayVerdict

ROOT: Final = -1
"""The layer number of the root's own output in the flight recorder's flags (the root need
not be a selected module)."""


def nonfinite(tensor: Tensor) -> bool:
    """Whether ``tensor`` holds a NaN or an infinity (exact; reads it now)."""
    values = real_values(tensor)
    if values is None:
        return False
    low, high = torch.aminmax(values)
    return not (bool(torch.isfinite(low)) and bool(torch.isfinite(high)))


class StepRecord:
    """What re-running one root forward needs (kept by the forward's flight-recorder state,
    and by its gradient hooks until its backward): references to its arguments, their version
    counters, the RNG states it started with, its grad mode and autocast state, and, while its
    backward runs, the gradient that flowed into each of the root's output tensors."""

    __slots__ = (
        "args",
        "autocast",
        "cpu_rng",
        "cuda_rng",
        "grad_enabled",
        "kwargs",
        "output_grads",
        "plain",
        "tensors",
        "versions",
    )

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> None:
        self.args = args
        self.kwargs = kwargs or {}
        self.plain = not kwargs and all(type(a) is Tensor for a in args)
        """Whether the arguments are tensors only, positional (the usual batch)."""
        tensors = args if self.plain else tuple(t for _, t in tensor_leaves((args, self.kwargs)))
        self.tensors: tuple[Tensor, ...] = tensors
        # (an inference tensor keeps no version counter: changed in place or not, unknown)
        self.versions = [-1 if t.is_inference() else _torch.version(t) for t in tensors]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng: tuple[tuple[int, Tensor], ...] = ()
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            devices = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
            self.cuda_rng = tuple((d, torch.cuda.get_rng_state(d)) for d in devices)
        self.grad_enabled = torch.is_grad_enabled()
        self.autocast = _autocast_state()
        self.output_grads: dict[int, Tensor] = {}
        """Position of the root's output tensor (``tensor_leaves`` order) -> its gradient."""

    @property
    def device(self) -> str:
        """Where the step ran, as far as its arguments tell (``cpu`` when none says)."""
        return next((str(t.device) for t in self.tensors if not t.is_cpu), "cpu")

    def _paths(self) -> list[tuple[str, Tensor]]:
        """Each tensor argument with where it is (``args[0]``, ``kwargs['mask']``)."""
        if self.plain:
            return [(f"args[{i}]", t) for i, t in enumerate(self.tensors)]
        return [
            (f"args{path[3:]}" if path.startswith("[0]") else f"kwargs{path[3:]}", tensor)
            for path, tensor in tensor_leaves((self.args, self.kwargs))
        ]

    def inputs_with_gradients(self) -> list[tuple[str, Tensor]]:
        """The tensor arguments that are leaves requiring grad and hold a ``.grad``
        (``args[0].grad``, ...)."""
        if not any(t.requires_grad and t.is_leaf and t.grad is not None for t in self.tensors):
            return []
        return [
            (f"{where}.grad", t)
            for where, t in self._paths()
            if t.requires_grad and t.is_leaf and t.grad is not None
        ]

    def why_not_replayable(self) -> str | None:
        """Why this step cannot be re-run as it ran (None: it can)."""
        for tensor, version in zip(self.tensors, self.versions, strict=True):
            if version >= 0 and _torch.version(tensor) != version:
                where = next((w for w, t in self._paths() if t is tensor), "?")
                return (
                    f"the argument {where} was changed in place since the forward started (its "
                    f"version counter moved from {version} to {_torch.version(tensor)}): the value "
                    "the step ran on is gone"
                )
        for item in (*self.args, *self.kwargs.values()):
            if isinstance(item, collections.abc.Iterator):
                return (
                    f"an argument is an iterator ({type(item).__name__}): re-running the "
                    "forward would consume it"
                )
        return None


def _autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    if not _torch.any_autocast_enabled():
        return ()
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in ("cpu", "cuda")
        if torch.is_autocast_enabled(device)
    )


@dataclass(frozen=True)
class Finding:
    """One non-finite value a replay met, in the order met."""

    kind: str
    """Forward: ``input`` (a tensor a module received), ``parameter`` (a module's own
    parameter), ``output`` (a tensor it returned; :data:`ROOT`: the root's output, made by
    code outside the selection). Backward: ``root_gradient`` (the saved gradient into the
    root's output: from the loss), ``output_gradient`` (the gradient into a module's output),
    ``input_gradient`` (the gradient into a tensor a module received: made by its backward),
    ``parameter_gradient`` (the gradient of a module's parameter)."""
    layer: int
    path: str
    tensor: tuple[int, int] | None = None
    """Backward: the node and output number whose gradient it was (several probes watch one
    tensor: its producer's output and its consumers' input)."""


@dataclass(frozen=True)
class Verdict:
    """What a replay found: the event's ``replay`` and ``replay_reason``, and the modules it
    names (``layers`` / ``paths``; the first is the event's ``layer``; :data:`ROOT` for the
    root). Empty names: the replay names none (the caller keeps what the check saw)."""

    replay: ReplayVerdict
    reason: str
    layers: tuple[int, ...] = ()
    paths: tuple[str, ...] = ()


class Replayer:
    """Re-runs a step of one observed model with checks on its selected modules."""

    def __init__(
        self,
        eager: nn.Module,
        modules: Sequence[nn.Module],
        names: Sequence[str],
        *,
        rank: int,
        reduced: Callable[[], bool],
        bypass: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> None:
        # Weakly: the model holds its observer, which holds this.
        self._eager_ref = weakref.ref(eager)
        self._module_refs = [weakref.ref(m) for m in modules]
        self._names = list(names)
        self._rank = rank
        self.next_stage: int | None = None
        """The next stage's index when the model is a pipeline stage other than the last (its
        output's gradient comes from that stage's rank), else None."""
        self._reduced = reduced
        """Whether the step's parameter gradients are known to be reduced across ranks."""
        self._bypass = bypass
        self._lock = threading.Lock()
        self.replays = 0
        """Replays run so far."""

    @property
    def _eager(self) -> nn.Module:
        eager = self._eager_ref()
        if eager is None:  # pragma: no cover - the model holds its observer
            raise ReferenceError("the observed model is gone")
        return eager

    @property
    def _modules(self) -> list[nn.Module | None]:
        return [ref() for ref in self._module_refs]

    def parameters(self) -> list[tuple[int, str, nn.Parameter]]:
        """The selected modules' own parameters, each once, with its layer and name."""
        found = []
        seen: set[int] = set()
        for layer, module in enumerate(self._modules):
            if module is None:
                continue
            for name, parameter in module.named_parameters(recurse=False):
                if id(parameter) not in seen:
                    seen.add(id(parameter))
                    found.append((layer, name, parameter))
        return found

    def replay(self, step: StepRecord, signal: str, device: str) -> Verdict:
        """Re-run ``step`` (its forward; with ``signal`` ``output_gradient`` its backward too)
        and judge it (module docstring). ``device``: where the step's result was not finite
        (named when the replay is clean)."""
        why = replay_context.collectives_in_forward(self._eager) or step.why_not_replayable()
        gradients = signal == "output_gradient"
        if why is None and gradients and not step.output_grads:
            why = (
                "no gradient of the root's output was kept: the backward did not start from "
                "the observed model's output"
            )
        if why is not None:
            return Verdict("not_replayable", why)
        with self._lock:
            self.replays += 1
            findings = self._run(step, gradients)
        return self._judge(findings, gradients, device)

    def _run(self, step: StepRecord, gradients: bool) -> list[Finding]:
        findings: list[Finding] = []
        probes = _Probes(self._modules, findings, gradients)
        with (
            self._bypass(),
            replay_context.eager_stance(),
            replay_context.rng_of(step.cpu_rng, step.cuda_rng),
            replay_context.buffers_kept(self._eager),
            replay_context.attributes_kept(self._eager),
            torch.set_grad_enabled(gradients),  # a forward's values do not depend on it
            replay_context.autocast(step.autocast),
            probes.installed(),
        ):
            output = self._eager(*step.args, **step.kwargs)
            leaves = tensor_leaves(output)
            if not findings:
                for path, tensor in leaves:
                    if nonfinite(tensor):
                        findings.append(Finding("output", ROOT, path))
                        break
            if gradients and not findings:
                with probes.parameters(self.parameters()):
                    self._backward(step, leaves, findings)
        return findings

    def _backward(
        self, step: StepRecord, leaves: list[tuple[str, Tensor]], findings: list[Finding]
    ) -> None:
        outputs, grads = [], []
        for position, (path, tensor) in enumerate(leaves):
            grad = step.output_grads.get(position)
            if grad is None or not tensor.requires_grad:
                continue
            if nonfinite(grad):
                findings.append(Finding("root_gradient", ROOT, path))
                return
            outputs.append(tensor)
            grads.append(grad)
        if not outputs:
            return
        inputs: list[Tensor] = [p for p in self._eager.parameters() if p.requires_grad]
        inputs += [t for t in step.tensors if t.requires_grad and t.is_leaf]
        if inputs:  # nothing is accumulated into .grad: the gradients come back here
            torch.autograd.grad(outputs, inputs, grads, allow_unused=True)

    def _judge(self, findings: list[Finding], gradients: bool, device: str) -> Verdict:
        where = f"rank {self._rank}, device {device}"
        if not findings:
            return self._clean(gradients, where)
        first = findings[0]
        kind = first.kind
        if kind == "input":
            return Verdict(
                "reproduced",
                f"what {self._name(first.layer)} received ({first.path}) was already not "
                "finite: it came with the batch or from code outside the selected modules",
                (ROOT,),
                ("",),
            )
        if kind == "parameter":
            return Verdict(
                "reproduced",
                f"the parameter {first.path} of {self._name(first.layer)} was already not "
                "finite (an earlier update)",
                (first.layer,),
                (first.path,),
            )
        if kind == "output":
            if first.layer == ROOT:
                return Verdict(
                    "reproduced",
                    f"the model's output {first.path or '(the tensor)'} is not finite while "
                    "every selected module's output was: made by code outside the selected "
                    "modules",
                    (ROOT,),
                    (first.path,),
                )
            outputs = [f for f in findings if f.kind == "output"]
            return Verdict(
                "reproduced",
                f"{self._name(first.layer)} is the first module whose output is not finite "
                "(what it received was finite): real numerics",
                tuple(f.layer for f in outputs),
                tuple(f.path for f in outputs),
            )
        if kind == "root_gradient" and self.next_stage is not None:
            return Verdict(
                "from_another_rank",
                "the gradient flowing into this pipeline stage's output was already not finite "
                f"when it arrived from stage {self.next_stage}: the non-finite value came from "
                f"that stage's rank ({where} replays its own part clean up to there)",
                (ROOT,),
                (first.path,),
            )
        if kind == "root_gradient":
            return Verdict(
                "reproduced",
                "the gradient flowing into the model's output was already not finite: it came "
                "from the loss, outside the model",
                (ROOT,),
                (first.path,),
            )
        return self._backward_verdict(findings, first)

    def _clean(self, gradients: bool, where: str) -> Verdict:
        """The verdict of a replay that found nothing: another rank's value, or a transient
        fault."""
        if gradients and self._reduced():
            return Verdict(
                "from_another_rank",
                f"this rank's own forward and backward replay clean ({where}) while its "
                "gradients, reduced across ranks, were not finite: the non-finite value "
                "came from another rank through the reduction",
            )
        what = "gradients were" if gradients else "output was"
        ranks = replay_context.world_size()
        maybe = (
            f" (or, if this process group of {ranks} ranks reduces the gradients, a value "
            "from another rank)"
            if gradients and ranks > 1
            else ""
        )
        return Verdict(
            "not_reproduced",
            f"the step's {what} not finite ({where}) but its replay is clean: a transient "
            f"fault of the device or a non-deterministic kernel{maybe}",
        )

    def _backward_verdict(self, findings: list[Finding], first: Finding) -> Verdict:
        """The verdict when the first finding is in the backward below the root's output."""
        # The backward: probes on one tensor fire together (its producer's output, its
        # consumers' input): a consumer made it when one watches it.
        same = [f for f in findings if f.tensor == first.tensor]
        made = [f for f in same if f.kind in ("input_gradient", "parameter_gradient")]
        if made:
            layers = tuple(dict.fromkeys(f.layer for f in made))
            which = (
                self._name(layers[0])
                if len(layers) == 1
                else ("one of " + ", ".join(self._name(layer) for layer in layers))
            )
            return Verdict(
                "reproduced",
                f"the backward of {which} made the first non-finite gradient "
                f"({made[0].path}, while the gradient into its output was finite): real "
                "numerics",
                layers,
                tuple(f.path for f in made if f.layer in layers)[: len(layers)],
            )
        return Verdict(
            "reproduced",
            f"the gradient flowing into {self._name(first.layer)}'s output ({first.path}) is "
            "the first non-finite gradient, made by the backward of code outside the selected "
            "modules",
            (ROOT, first.layer),
            ("", first.path),
        )

    def _name(self, layer: int) -> str:
        return "the model" if layer == ROOT else repr(self._names[layer])


class _Probes:
    """The replay's checks on every selected module, installed for its length only."""

    def __init__(
        self, modules: Sequence[nn.Module | None], findings: list[Finding], gradients: bool
    ) -> None:
        self._modules = modules
        self._findings = findings
        self._gradients = gradients

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        handles = []
        try:
            for layer, module in enumerate(self._modules):
                if module is None:
                    continue
                handles.append(
                    module.register_forward_pre_hook(self._received(layer), with_kwargs=True)
                )
                handles.append(module.register_forward_hook(self._made(layer)))
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def parameters(self, owned: Sequence[tuple[int, str, nn.Parameter]]) -> Iterator[None]:
        """Hooks on the selected parameters for the replayed backward (they see each gradient
        as it is made, in backward order)."""
        handles = []
        try:
            for layer, name, parameter in owned:
                if parameter.requires_grad:
                    probe = _ParameterProbe(self._findings, layer, f"{name}.grad")
                    handles.append(parameter.register_hook(probe))  # type: ignore[no-untyped-call]
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _received(self, layer: int) -> Callable[..., None]:
        findings = self._findings
        gradients = self._gradients

        def check(module: nn.Module, args: Any, kwargs: Any) -> None:
            for path, tensor in tensor_leaves((args, kwargs)):
                if not findings and nonfinite(tensor):
                    findings.append(Finding("input", layer, path))
                if gradients:
                    _watch(tensor, findings, "input_gradient", layer, f"{path}.grad")
            if findings:
                return
            for name, parameter in module.named_parameters(recurse=False):
                if nonfinite(parameter):
                    findings.append(Finding("parameter", layer, name))
                    return

        return check

    def _made(self, layer: int) -> Callable[..., None]:
        findings = self._findings
        gradients = self._gradients

        def check(module: nn.Module, args: Any, output: Any) -> None:
            for path, tensor in tensor_leaves(output):
                if (not findings or findings[0].kind == "output") and nonfinite(tensor):
                    findings.append(Finding("output", layer, path))
                if gradients:
                    _watch(tensor, findings, "output_gradient", layer, path)

        return check


def _watch(tensor: Tensor, findings: list[Finding], kind: str, layer: int, path: str) -> None:
    """A pre-hook on the node that made ``tensor``: checks the gradient flowing into it."""
    node = tensor.grad_fn
    if tensor.requires_grad and node is not None:
        node.register_prehook(_GradientProbe(findings, kind, layer, path, node, tensor.output_nr))


class _GradientProbe:
    """Pre-hook of the node that made a tensor a selected module returned or received, in a
    replayed forward: checks the gradient flowing into that tensor."""

    __slots__ = ("findings", "key", "kind", "layer", "output_nr", "path")

    def __init__(
        self,
        findings: list[Finding],
        kind: str,
        layer: int,
        path: str,
        node: object,
        output_nr: int,
    ) -> None:
        self.findings = findings
        self.kind = kind
        self.layer = layer
        self.path = path
        self.key = (id(node), output_nr)
        self.output_nr = output_nr

    def __call__(self, grad_outputs: tuple[Tensor | None, ...]) -> None:
        findings = self.findings
        if findings and findings[0].tensor != self.key:
            return  # only the first non-finite tensor matters (and every probe on it)
        grad = grad_outputs[self.output_nr]
        if grad is not None and nonfinite(grad):
            findings.append(Finding(self.kind, self.layer, self.path, self.key))


class _ParameterProbe:
    """Hook of a selected parameter in a replayed backward: checks its gradient."""

    __slots__ = ("findings", "layer", "path")

    def __init__(self, findings: list[Finding], layer: int, path: str) -> None:
        self.findings = findings
        self.layer = layer
        self.path = path

    def __call__(self, grad: Tensor) -> None:
        if not self.findings and nonfinite(grad):
            self.findings.append(Finding("parameter_gradient", self.layer, self.path, (0, 0)))


__all__ = [
    "ROOT",
    "Finding",
    "Replayer",
    "StepRecord",
    "Verdict",
    "nonfinite",
]
