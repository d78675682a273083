"""``inject_observer`` / ``remove_observer`` / ``has_observer`` / ``observe``.

Everything is validated before the model is touched or a sink is opened, so a bad argument (or a
sink that refuses to open) leaves the model exactly as it was.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import UTC, datetime, timedelta
from importlib import metadata
from os import PathLike
from typing import Final, Literal, Unpack

from torch import nn

from ti_core import aligned_sampling, legacy, preemption, resolve
from ti_core.capture.hooks import scrub_copied_hooks
from ti_core.cost import CostMeter, MeteredSampler
from ti_core.emission.records import RunColumns
from ti_core.emission.sinks import read_capabilities
from ti_core.errors import ErrorPolicy, ObserverAlreadyAttachedError
from ti_core.observer import Observer
from ti_core.options import DEFAULT_OUTPUT_DIR, ObserverOptions, Options
from ti_core.reduction import placement
from ti_core.reduction.plan import ReductionPlan, default_reducers
from ti_core.reduction.precision import with_precision
from ti_core.reduction.stability import with_metrics
from ti_core.sampling import (
    DEFAULT_INTERVAL,
    Sampler,
    TimedSampler,
)
from ti_core.selection import check_compiled_model, select_modules, unwrap_model
from ti_core.sentinel import Event
from ti_core.sentinel.options import check_forwards
from ti_core.sink import RunInfo, Sink
from ti_schema import (
    histogram_schema,
    history_schema,
)

ATTRIBUTE: Final = "_ti_observer"
"""Key of the observer in the model's ``__dict__`` (never a submodule, parameter or buffer);
private: reach the observer with :func:`observer_of`."""


def _producer() -> str:
    try:
        return f"ti-core {metadata.version('ti-core')}"
    except metadata.PackageNotFoundError:  # pragma: no cover - source tree without install
        return "ti-core unknown"


def observer_of(model: nn.Module) -> Observer | None:
    """The observer attached to ``model``, or None (also for copies of an observed model).

    For tests, benchmarks and diagnostics: ``drain()`` waits for the emission worker,
    ``emission_thread`` and ``state`` tell what it is doing, ``run`` holds the run's facts.
    """
    observer = getattr(model, "__dict__", {}).get(ATTRIBUTE)
    return observer if isinstance(observer, Observer) else None


def has_observer(model: nn.Module) -> bool:
    """True when ``model`` has an attached observer."""
    return observer_of(model) is not None


def _check_sink(candidate: object, where: str) -> Sink:
    if isinstance(candidate, type):
        name = candidate.__name__
        raise TypeError(f"{where} got the class {name}; pass an instance, e.g. {name}()")
    if not isinstance(candidate, Sink):
        raise TypeError(
            f"{where} must implement the Sink protocol (open, write_history, write_histograms, "
            f"close), got {candidate!r}; e.g. sink=MemorySink()"
        )
    return candidate


def _resolve_sinks(
    output_dir: str | PathLike[str] | None, sink: Sink | Sequence[Sink] | None
) -> list[Sink]:
    """The run's sinks: the directory sink for ``output_dir`` (ti-io), then those of ``sink=``.

    ``sink=`` adds to the directory: ``output_dir`` keeps its default ``"stats"`` unless it is
    passed as None (the in-memory / own-sink form, which needs only ti-core). A directory sink
    given in ``sink=`` (for its settings) is the run's directory: the default adds no second one.
    """
    given: list[Sink] = []
    if sink is not None:
        if isinstance(sink, Sink) and not isinstance(sink, type):
            given = [sink]
        elif isinstance(sink, Sequence) and not isinstance(sink, str | bytes):
            given = [_check_sink(s, f"sink[{i}]") for i, s in enumerate(sink)]
            if not given:
                raise ValueError("sink= is an empty sequence; pass at least one Sink or None")
            if len({id(s) for s in given}) != len(given):
                raise ValueError("sink= lists the same sink object twice")
        else:
            _check_sink(sink, "sink=")
    if output_dir is None:
        if not given:
            raise ValueError(
                "output_dir=None and no sink=: nothing would receive the records; keep them in "
                "memory with sink=MemorySink(), output_dir=None, or pass an output_dir"
            )
        return given
    if not isinstance(output_dir, str | PathLike):
        raise TypeError(f"output_dir= must be a path (str or os.PathLike), got {output_dir!r}")
    default = output_dir is DEFAULT_OUTPUT_DIR
    factory = resolve.directory_sink_factory()
    if factory is None:
        raise resolve.missing_directory_sink(default=default, with_sinks=bool(given))
    if isinstance(factory, type) and any(isinstance(s, factory) for s in given):
        if default:
            return given
        raise ValueError(
            f"output_dir={str(output_dir)!r} and a {factory.__name__} in sink= both name a "
            "directory: pass the directory once, either output_dir= or sink=, not both"
        )
    return [
        _check_sink(factory(output_dir), f"the directory sink for output_dir={output_dir!r}"),
        *given,
    ]


def _resolve_sampler(sampler: Sampler | None, interval: timedelta | float) -> Sampler:
    if sampler is None:
        return TimedSampler(interval)
    if interval is not DEFAULT_INTERVAL:
        raise ValueError(
            "sampler= and interval= were both given; interval= only configures the default "
            "TimedSampler: pass sampler=TimedSampler(interval) or interval= alone"
        )
    if isinstance(sampler, type) or not callable(getattr(sampler, "should_sample", None)):
        raise TypeError(
            f"sampler= must have should_sample(forward_index) -> bool (e.g. AlwaysSampler(), "
            f"EveryNForwardsSampler(n), TimedSampler(interval)), got {sampler!r}"
        )
    return sampler


def inject_observer(model: nn.Module, **options: Unpack[ObserverOptions]) -> None:
    """Attach an observer that records selected modules' outputs and output gradients.

    ``signals`` chooses what is recorded (default ``("output", "output_gradient")``); the
    opt-in ``"parameter"``, ``"parameter_gradient"`` and ``"parameter_update"`` measure the
    parameters each selected module owns directly, their ``.grad`` after the sampled forward's
    backward, and the change the next optimizer step makes to them; ``"optimizer_state"`` an
    Adam-type optimizer's moments of them after that step; ``"attention"`` the attention
    logits of the ``scaled_dot_product_attention`` calls inside a selected module;
    ``"input"`` each tensor among a selected call's arguments, as the call starts
    (docs/capture.md).
    ``update_budget_bytes`` bounds the copies that measuring updates needs (default 256 MiB);
    parameters beyond it get unavailable rows naming it.

    Sampling is decided per root forward (``sampler``; default ``TimedSampler(interval)``).
    Records go to the directory sink of ti-io for ``output_dir`` (default ``"stats"``) and to
    every sink in ``sink`` (one or several), which adds to the directory; ``output_dir=None``
    keeps only ``sink`` (``sink=MemorySink(), output_dir=None``: in memory, ti-core alone). A
    ti-io ``DirectorySink`` in ``sink`` is the run's directory instead of the default. Raises
    before touching the model on bad input; ``ObserverAlreadyAttachedError`` if one is attached
    already. When the rank policy says this process does not observe, nothing is attached and
    ``has_observer`` stays False.

    ``handle_sigterm`` (default True): on SIGTERM (preemption), publish what the observer holds
    (bounded time), then run the previous handler or the default action unchanged; installed
    from the main thread only. Pass False when the program manages its signals itself
    (docs/reliability.md, "Preemption"). At interpreter exit without ``remove_observer`` the
    observer's rows are published either way.

    ``precision`` (default none): low-precision formats, named as torch dtypes
    (``"bfloat16"``, ``"float16"``, ``"float8_e4m3fn"``, ``"float8_e5m2"``, and the block-scaled
    ``"mxfp8_e4m3"``); every measured tensor then also gets ``min_abs_nonzero`` and, per
    format, ``underflow_fraction.F``, ``subnormal_fraction.F`` and ``overflow_fraction.F``:
    what casting it to ``F`` would lose, exactly as ``tensor.to(F)`` (docs/metrics.md).

    ``sentinel`` (default True): the flight recorder. On every root forward, sampled or not,
    it checks the root's output and, when each backward ends, the selected modules' parameter
    gradients for NaN and infinity; when one is not finite it replays the step with a check on
    every module, records a ``nonfinite`` event naming the first module with the replay's
    verdict (real numerics, a transient fault of the device, a value from another rank, or
    not replayable), and samples the next ``dense_forwards`` root forwards in full.
    ``Sentinel(...)`` sets its options (``mode="dense"``: every module checked on every
    forward, no replay); ``False`` turns it off (docs/capture.md, "Flight recorder").

    ``metrics`` (default: the nine of the default profile, ``ti_schema.DEFAULT_METRICS``): the
    declared metrics each measured tensor gets; add ``ti_schema.STABILITY_METRICS`` (``rms``,
    ``kurtosis``, ``max_abs``) for what the training-instability literature watches
    (docs/metrics.md). ``mean``, ``std``, ``min`` and ``max`` are always kept.

    ``settings`` (default none): the caller's own run settings, string to string, recorded
    beside ti-core's (run.json, index.md) for readers to find (e.g. an experiment's tag;
    :func:`~ti_core.inject_stage_observer` records a pipeline stage's this way). A key ti-core
    records itself is refused.
    """
    _check_model(model)  # first, as before the options were one object
    attach(model, Options.of(options, "inject_observer"))


def attach(model: nn.Module, options: Options) -> None:
    """Attach an observer to ``model`` with ``options`` (what :func:`inject_observer` does once
    its keyword arguments are an :class:`~ti_core.options.Options`): everything is resolved and
    checked, then the sinks are opened, then the hooks installed."""
    _check_model(model)
    sampler = _resolve_sampler(options.sampler, options.interval)
    policy = resolve.rank_policy(options.rank_policy)
    check_compiled_model(model)
    selection = select_modules(
        unwrap_model(model),
        options.selector,
        options.histogram_selector,
        options.max_histogram_modules,
    )
    reducers = default_reducers() if options.reducers is None else options.reducers
    adapted = legacy.adapt_reducers(reducers)
    plan = ReductionPlan(
        with_precision(with_metrics(adapted.reducers, options.metrics), options.precision)
    )
    sinks = _resolve_sinks(options.output_dir, legacy.adapt_sinks(options.sink, selection.modules))
    capabilities = read_capabilities(sinks)  # TypeError for a malformed one, before any opens
    ranks = resolve.select_rank(policy)
    if not ranks.observe:
        return
    # The run's telemetry cost (ti_core.cost): a sampler that reads it is bound before any
    # wrapper (rank alignment) hides it.
    meter = CostMeter()
    if isinstance(sampler, MeteredSampler):
        sampler.bind_meter(meter)
    described_sampler = repr(sampler)
    sampler, alignment = aligned_sampling.align(sampler, policy, ranks)
    producer = _producer()
    metrics = tuple(plan.metric_names)
    run = RunInfo(
        run_id=uuid.uuid4().hex,
        rank=ranks.rank,
        world_size=ranks.world_size,
        producer=producer,
        started_at=datetime.now(UTC),
        layers=selection.layers,
        focus_layers=tuple(selection.layers[i].name for i in selection.focus),
        metrics=metrics,
        sampler=described_sampler,
        rank_subdir=ranks.subdir,
        settings=options.run_settings(notes=adapted.notes, alignment=alignment),
    )
    columns = RunColumns(
        history_schema=history_schema(producer),
        histogram_schema=histogram_schema(producer),
        run_id=run.run_id,
        rank=run.rank,
        layer_names=tuple(layer.name for layer in selection.layers),
        module_types=tuple(layer.module_type for layer in selection.layers),
        metric_names=metrics,
    )
    _open_sinks(sinks, run)
    reset = getattr(sampler, "reset", None)
    if callable(reset):
        reset()
    errors = ErrorPolicy(options.error_policy)
    observer = Observer(
        root=model,
        modules=selection.modules,
        focus=selection.focus,
        run=run,
        sinks=sinks,
        sampler=sampler,
        plan=plan,
        errors=errors,
        capture_direct_forwards=options.capture_direct_forwards,
        columns=columns,
        capabilities=capabilities,
        background=placement.worker_allowed(
            default_only=plan.default_only, raises=errors.raises, capabilities=capabilities
        ),
        signals=options.chosen_signals,
        update_budget_bytes=options.update_budget_bytes,
        sentinel=options.chosen_sentinel,
        meter=meter,
    )
    model.__dict__[ATTRIBUTE] = observer
    observer.attach(model)
    preemption.watch(observer, handle_sigterm=options.handle_sigterm)


def _check_model(model: object) -> None:
    """A module without an observer, or the error that says what to pass instead."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module, got {type(model).__name__}; pass the module "
            "itself (for a Lightning or HF wrapper, its nn.Module)"
        )
    if has_observer(model):
        raise ObserverAlreadyAttachedError(
            f"{type(model).__name__} already has an observer; call remove_observer(model) first"
        )


def _open_sinks(sinks: Sequence[Sink], run: RunInfo) -> None:
    """Open every sink for ``run``; when one refuses, close those already open and raise."""
    opened: list[Sink] = []
    try:
        for s in sinks:
            s.open(run)
            opened.append(s)
    except BaseException:
        for s in reversed(opened):
            with suppress(Exception):  # the open failure is the error worth reporting
                s.close()
        raise


def remove_observer(model: nn.Module) -> None:
    """Detach the observer: remove every hook and override, close each sink exactly once.

    A no-op on a model without an observer. Close failures are reported through the error policy
    after every sink was given its chance to close.
    """
    observer = observer_of(model)
    if observer is None:
        if isinstance(model, nn.Module):  # a copy of an observed model: drop what it inherited
            model.__dict__.pop(ATTRIBUTE, None)
            for module in model.modules():
                scrub_copied_hooks(module)
        return
    try:
        failures = observer.detach()
    finally:
        del model.__dict__[ATTRIBUTE]
        preemption.unwatch(observer)  # after detach: a SIGTERM meanwhile still publishes
    for sink, error in failures:
        observer.sinks.report(sink, "closing", error)


def trigger_capture(
    model: nn.Module,
    *,
    forwards: int | None = None,
    reason: str,
    kind: Literal["manual", "loss"] = "manual",
    value: float | None = None,
) -> Event | None:
    """Ask for a dense capture now: the next ``forwards`` root forwards of ``model`` are
    sampled in full, whatever the sampler says (default: the sentinel's ``dense_forwards``,
    else 4), and a ``ti.events`` row of ``kind`` (``"manual"``; ``"loss"`` for a loss test,
    with the loss as ``value``) records ``reason``.

    For a training loop's own test, e.g. ``if loss > 3 * running_mean: trigger_capture(model,
    reason="loss spike")``. Works with or without the sentinel. Returns the event, or None
    when ``model`` has no observer (this rank does not observe). Bad arguments raise whether
    or not there is an observer.
    """
    if forwards is not None:
        check_forwards(forwards, "trigger_capture(forwards=...)")
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(
            f"trigger_capture(reason=...) must be a non-empty string saying why, got {reason!r}"
        )
    if kind not in ("manual", "loss"):
        raise ValueError(
            f"trigger_capture(kind=...) must be 'manual' or 'loss', got {kind!r} ('nonfinite' "
            "events come from the sentinel)"
        )
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"trigger_capture(value=...) must be a float or None, got {value!r}")
        value = float(value)
    observer = observer_of(model)
    if observer is None:
        return None
    try:
        return observer.recorder.trigger(kind, forwards=forwards, reason=reason, value=value)
    except Exception as error:
        observer.errors.handle("capture trigger", error)
        return None


@contextmanager
def observe(model: nn.Module, **options: Unpack[ObserverOptions]) -> Iterator[nn.Module]:
    """``with observe(model, sink=MemorySink(), output_dir=None): train(model)``: inject on
    enter, remove on exit."""
    inject_observer(model, **options)
    try:
        yield model
    finally:
        remove_observer(model)
