"""inject_observer's contract: validation before touching anything, sinks, ranks, providers."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
from datetime import timedelta
from importlib import metadata
from pathlib import Path
from typing import Any, ForwardRef, get_args

import pyarrow as pa
import pytest
import torch
from _core_helpers import hook_state, rows
from torch import nn

from ti_core import (
    AlwaysSampler,
    ErrorPolicyName,
    EveryNForwardsSampler,
    MemorySink,
    MissingProviderError,
    ObserverAlreadyAttachedError,
    RankSelection,
    Reducer,
    RunInfo,
    TimedSampler,
    has_observer,
    inject_observer,
    observe,
    remove_observer,
    resolve,
)
from ti_core.capture.hooks import CallOverride, PassthroughCall
from ti_core.options import OPTION_NAMES, ObserverOptions, Options
from ti_schema import DEFAULT_METRICS
from ti_schema.testing import assert_histograms_conform


def small_model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def _ti_io_installed() -> bool:
    return any(ep.name == "directory" for ep in metadata.entry_points(group="ti.sinks"))


class RecordingSink(MemorySink):
    """A MemorySink that can be told to fail when opened."""

    def __init__(self, fail_open: bool = False) -> None:
        super().__init__()
        self.fail_open = fail_open

    def open(self, run: RunInfo) -> None:
        if self.fail_open:
            raise FileExistsError("refusing to open")
        super().open(run)


BAD_INPUTS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"sampler": EveryNForwardsSampler}, TypeError, "should_sample"),
    ({"interval": timedelta(0)}, ValueError, "interval"),
    ({"interval": -3.0}, ValueError, "interval"),
    ({"interval": "60s"}, TypeError, "interval"),
    (
        {"sampler": AlwaysSampler(), "interval": timedelta(seconds=5)},
        ValueError,
        "sampler= and interval=",
    ),
    ({"histogram_selector": lambda n, m: n == "nope"}, ValueError, "histogram_selector"),
    ({"histogram_selector": ["missing.layer"]}, ValueError, "missing.layer"),
    ({"selector": lambda n, m: False}, ValueError, "selector"),
    ({"selector": "leaf"}, TypeError, "selector"),
    ({"rank_policy": "rank7"}, ValueError, "rank0"),
    ({"rank_policy": 3}, TypeError, "rank_policy"),
    ({"error_policy": "loud"}, ValueError, "error_policy"),
    ({"error_policy": 1}, TypeError, "error_policy"),
    ({"max_histogram_modules": -1}, ValueError, "max_histogram_modules"),
    ({"max_histogram_modules": 2.5}, TypeError, "max_histogram_modules"),
    ({"capture_direct_forwards": "yes"}, TypeError, "capture_direct_forwards"),
    ({"sink": object()}, TypeError, "Sink protocol"),
    ({"sink": []}, ValueError, "empty"),
    ({"reducers": "mean"}, TypeError, "reducers"),
    ({"reducers": Reducer("l1", lambda t: t.abs().sum())}, TypeError, r"reducers=\[\*default"),
    ({"reducers": []}, ValueError, "reducers is empty"),
]


@pytest.mark.parametrize(("options", "error", "message"), BAD_INPUTS)
def test_bad_input_raises_and_leaves_the_model_untouched(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    model = small_model()
    before = hook_state(model)
    sink = MemorySink()
    options = {"sink": sink, "output_dir": None, **options}
    with pytest.raises(error, match=message):
        inject_observer(model, **options)
    assert hook_state(model) == before
    assert not has_observer(model)
    assert sink.open_count == 0


def test_n_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="n >= 1"):
        EveryNForwardsSampler(0)
    with pytest.raises(ValueError, match="positive"):
        TimedSampler(timedelta(seconds=0))


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        inject_observer(lambda x: x, output_dir=None, sink=MemorySink())  # type: ignore[arg-type]


def test_double_injection_is_refused_and_keeps_the_first() -> None:
    model = small_model()
    first = MemorySink()
    inject_observer(model, output_dir=None, sink=first, sampler=AlwaysSampler())
    state = hook_state(model)
    second = MemorySink()
    with pytest.raises(ObserverAlreadyAttachedError, match="remove_observer"):
        inject_observer(model, output_dir=None, sink=second)
    assert hook_state(model) == state
    assert second.open_count == 0
    model(torch.randn(1, 3))
    remove_observer(model)
    assert first.table().num_rows > 0
    assert first.close_count == 1


def test_sink_open_failure_closes_opened_sinks_and_leaves_model_untouched() -> None:
    model = small_model()
    before = hook_state(model)
    good, bad = MemorySink(), RecordingSink(fail_open=True)
    with pytest.raises(FileExistsError):
        inject_observer(model, output_dir=None, sink=[good, bad])
    assert hook_state(model) == before
    assert not has_observer(model)
    assert good.open_count == 1
    assert good.close_count == 1


def test_several_sinks_get_the_same_records_and_close_once() -> None:
    model = small_model()
    a, b = MemorySink(), MemorySink()
    with observe(model, output_dir=None, sink=[a, b], sampler=AlwaysSampler()):
        assert has_observer(model)
        model(torch.randn(2, 3)).sum().backward()
    assert not has_observer(model)
    assert a.table().equals(b.table())
    assert a.table().num_rows > 0
    assert (a.close_count, b.close_count) == (1, 1)
    assert a.run is b.run


def test_run_info() -> None:
    model = small_model()
    sink = MemorySink()
    inject_observer(
        model,
        output_dir=None,
        sink=sink,
        sampler=EveryNForwardsSampler(4),
        histogram_selector=["2"],
        error_policy="ignore",
    )
    remove_observer(model)
    run = sink.run
    assert run is not None
    assert run.producer.startswith("ti-core ")
    assert [layer.name for layer in run.layers] == ["0", "1", "2"]
    assert [layer.module_type for layer in run.layers] == ["Linear", "ReLU", "Linear"]
    assert run.focus_layers == ("2",)
    assert run.metrics[:2] == ("mean", "std")
    assert len(run.metrics) == len(DEFAULT_METRICS)
    assert run.sampler == "EveryNForwardsSampler(n=4)"
    assert (run.rank, run.world_size, run.rank_subdir) == (0, 1, None)
    assert run.settings["error_policy"] == "ignore"


def test_default_focus_is_first_eight_selected_and_histograms_are_emitted() -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(10)])
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        model(torch.randn(3, 2)).sum().backward()
    assert sink.run is not None
    assert sink.run.focus_layers == tuple(str(i) for i in range(8))
    hist = sink.histograms()
    assert_histograms_conform(hist)
    assert {r["layer"] for r in hist.to_pylist()} == {str(i) for i in range(8)}
    assert {r["signal"] for r in hist.to_pylist()} == {"output", "output_gradient"}
    row = next(r for r in hist.to_pylist() if r["layer"] == "0" and r["signal"] == "output")
    assert row["num"] == 6
    assert sum(row["bucket_counts"]) == 6


class NoObservation:
    def select(self) -> RankSelection:
        return RankSelection(rank=3, world_size=4, observe=False)


def test_rank_policy_that_does_not_observe_attaches_nothing() -> None:
    model = small_model()
    before = hook_state(model)
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, rank_policy=NoObservation())
    assert not has_observer(model)
    assert hook_state(model) == before
    assert sink.open_count == 0
    model(torch.randn(1, 3))
    remove_observer(model)  # no-op
    assert sink.close_count == 0


class Rank2:
    def select(self) -> RankSelection:
        return RankSelection(rank=2, world_size=4, observe=True, subdir="rank-002")


def test_rank_policy_object_wins_and_sets_rank_column() -> None:
    model = small_model()
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, rank_policy=Rank2(), sampler=AlwaysSampler()):
        model(torch.randn(1, 3))
    assert sink.run is not None
    assert sink.run.rank_subdir == "rank-002"
    assert {r["rank"] for r in sink.table().to_pylist()} == {2}


def test_without_ti_dist_a_single_process_is_rank0_and_distributed_jobs_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # what resolve does when no ti.rank_policies entry point exists
    policy = resolve.SingleProcess("rank0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert policy.select() == RankSelection(0, 1, True, None)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(MissingProviderError, match="pip install ti-dist"):
        policy.select()


def test_rank_policy_names_resolve_through_entry_points() -> None:
    names = {ep.name for ep in metadata.entry_points(group="ti.rank_policies")}
    for name in ("rank0", "all"):
        policy = resolve.rank_policy(name)
        if name in names:
            assert type(policy).__module__.split(".")[0] != "ti_core"
        else:
            assert isinstance(policy, resolve.SingleProcess)
        assert callable(policy.select)
    with pytest.raises(ValueError, match="all, rank0"):
        resolve.rank_policy("everyone")


def test_default_output_dir_needs_ti_io(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = small_model()
    before = hook_state(model)
    if not _ti_io_installed():
        for options in ({}, {"sink": MemorySink()}):
            with pytest.raises(MissingProviderError, match="pip install ti-io") as info:
                inject_observer(model, **options)
            assert "output_dir=None" in str(info.value)
        assert hook_state(model) == before
        assert not list(tmp_path.iterdir())
    else:
        factory = resolve.directory_sink_factory()
        assert factory is not None
        assert isinstance(factory, type)
        # a directory sink in sink= plus output_dir= is ambiguous
        with pytest.raises(ValueError, match="output_dir= or sink="):
            inject_observer(model, output_dir=tmp_path / "a", sink=factory(tmp_path / "b"))
        assert hook_state(model) == before


def test_missing_directory_provider_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve, "directory_sink_factory", lambda: None)
    model = small_model()
    before = hook_state(model)
    memory = MemorySink()
    cases = [
        ({}, "output_dir='stats' by default"),
        ({"sink": memory}, "sink= adds to the run directory"),
        ({"output_dir": "somewhere", "sink": memory}, "output_dir= needs the directory sink"),
    ]
    for options, what in cases:
        with pytest.raises(MissingProviderError, match="pip install ti-io") as info:
            inject_observer(model, **options)
        assert what in str(info.value)
        assert "output_dir=None" in str(info.value)  # the other way out, named
    assert hook_state(model) == before
    assert memory.open_count == 0


class FakeDirectorySink(MemorySink):
    """Stands in for ti-io's DirectorySink (what ti.sinks/directory resolves to) where ti-io is
    not installed: remembers every instance and the directory it was made for."""

    made: list[FakeDirectorySink] = []  # noqa: RUF012 - reset by the test

    def __init__(self, output_dir: object) -> None:
        super().__init__()
        self.output_dir = str(output_dir)
        FakeDirectorySink.made.append(self)


def test_sink_adds_to_the_default_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """sink= is additive: the default output_dir="stats" still applies (torchinstruments 0.8.0
    wrote the directory artifacts next to a supplied sink); output_dir=None is the in-memory
    form; a directory sink in sink= is the run's directory."""
    monkeypatch.setattr(resolve, "directory_sink_factory", lambda: FakeDirectorySink)
    FakeDirectorySink.made = []
    model = small_model()
    memory = MemorySink()
    inject_observer(model, sink=memory, sampler=AlwaysSampler())
    model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    (directory,) = FakeDirectorySink.made
    assert directory.output_dir == "stats"
    assert (directory.open_count, directory.close_count) == (1, 1)
    assert directory.table().num_rows == memory.table().num_rows > 0  # both got every row

    FakeDirectorySink.made = []
    inject_observer(model, output_dir=None, sink=memory, sampler=AlwaysSampler())
    remove_observer(model)
    assert FakeDirectorySink.made == []
    assert memory.open_count == 2

    own = FakeDirectorySink("runs/a")
    inject_observer(model, sink=own, sampler=AlwaysSampler())
    remove_observer(model)
    assert FakeDirectorySink.made == [own]  # no second, default directory
    assert own.open_count == 1
    with pytest.raises(ValueError, match="output_dir= or sink="):
        inject_observer(model, output_dir="stats", sink=[memory, own])
    assert not has_observer(model)
    assert FakeDirectorySink.made == [own]


def test_output_dir_none_without_sink_is_refused() -> None:
    model = small_model()
    with pytest.raises(ValueError, match="nothing would receive the records"):
        inject_observer(model, output_dir=None)
    assert not has_observer(model)


def test_copies_are_unobserved_and_still_run() -> None:
    model = small_model()
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    model(torch.randn(1, 3))
    n_rows = sink.table().num_rows
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert not has_observer(clone)
        # per-module capture (a _call_impl override) stays installed while sampling; the copy
        # gets torch's own in its place
        assert isinstance(model[0].__dict__["_call_impl"], CallOverride)
        assert isinstance(clone[0].__dict__["_call_impl"], PassthroughCall)
        assert clone._forward_hooks  # the root's hooks
        out = clone(torch.randn(2, 3))
        out.sum().backward()
        assert out.shape == (2, 2)
        assert sink.table().num_rows == n_rows
        # a copy's inherited hooks are inert and remove themselves at their first call
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in clone.modules())
        assert all("_call_impl" not in m.__dict__ for m in clone.modules())
        remove_observer(clone)
    assert has_observer(model)
    model(torch.randn(1, 3))
    assert sink.table().num_rows > n_rows
    remove_observer(model)


def test_copy_of_direct_forward_override_runs_the_class_forward() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    sink = MemorySink()
    inject_observer(
        model, output_dir=None, sink=sink, sampler=AlwaysSampler(), capture_direct_forwards=True
    )
    model(torch.randn(1, 3))
    assert "forward" in model[0].__dict__  # overrides stay installed while sampling
    clone = copy.deepcopy(model)
    x = torch.randn(2, 3)
    torch.testing.assert_close(clone(x), model[1](model[0](x)))
    remove_observer(clone)
    assert "forward" not in clone[0].__dict__
    remove_observer(model)
    assert "forward" not in model[0].__dict__


def test_memory_sink_table_is_columnar_history() -> None:
    model = small_model()
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        model(torch.randn(2, 3)).sum().backward()
    table = sink.table()
    assert isinstance(table, pa.Table)
    assert table.schema.metadata is not None
    assert b"ti" in table.schema.metadata
    # 3 layers x 2 signals x the default metrics
    assert table.num_rows == 3 * 2 * len(DEFAULT_METRICS)
    assert len(rows(table, signal="output_gradient")) == 3 * len(DEFAULT_METRICS)


def test_the_options_are_declared_once_and_typed_alike() -> None:
    """``inject_observer(model, **options)`` and ``observe`` take ObserverOptions, which lists
    the fields of ``Options`` (the one declaration: names, types, defaults, checks) with the
    same types; an unknown name is refused as inject_observer's."""
    fields = {f.name: f.type for f in dataclasses.fields(Options) if f.init}
    declared = {
        name: a.__forward_arg__ if isinstance(a, ForwardRef) else a
        for name, a in ObserverOptions.__annotations__.items()
    }
    assert declared == fields
    assert tuple(fields) == OPTION_NAMES
    assert ObserverOptions.__required_keys__ == frozenset()
    for function in (inject_observer, observe):
        parameters = list(inspect.signature(function).parameters.values())
        assert [p.kind for p in parameters] == [
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.VAR_KEYWORD,
        ]
    with pytest.raises(
        TypeError, match=r"inject_observer\(\) got unexpected keyword argument\(s\) samplr"
    ):
        inject_observer(small_model(), samplr=None)  # type: ignore[call-arg]
    # the model is checked first, as when the options were keyword parameters
    observed = small_model()
    with (
        observe(observed, output_dir=None, sink=MemorySink()),
        pytest.raises(ObserverAlreadyAttachedError),
    ):
        inject_observer(observed, signals=())
    with pytest.raises(TypeError, match=r"must be a torch\.nn\.Module"):
        inject_observer("model", signals=())  # type: ignore[arg-type]
    # defaults: what a plain inject_observer(model) records
    default = Options()
    assert default.output_dir == "stats"
    assert default.chosen_signals == ("output", "output_gradient")
    assert default.run_settings(notes={}, alignment={})["signals"] == "output,output_gradient"


@pytest.mark.parametrize("name", get_args(ErrorPolicyName))
def test_every_error_policy_name_is_accepted(name: str) -> None:
    assert get_args(ErrorPolicyName) == ("warn", "ignore", "raise")
    sink = MemorySink()
    with observe(small_model(), output_dir=None, sink=sink, error_policy=name):
        pass
    assert sink.run is not None
    assert sink.run.settings["error_policy"] == name
