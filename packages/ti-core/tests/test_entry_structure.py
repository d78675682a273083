"""Entry structures reused across samples (``ti_core.reduction.batch.StructureMemo``).

A batch whose rows, slots, shapes and dtypes equal a remembered batch's reuses that batch's
identity columns; anything else must build its own. The rows written must be those of a batch
that built everything itself, with each sample's own times.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from ti_core import AlwaysSampler, MemorySink, inject_observer, remove_observer
from ti_core.emission.records import RunColumns, history_batch
from ti_core.entries import Entries
from ti_core.reduction.batch import EntryStructure, StructureMemo, TensorBatch
from ti_core.reduction.plan import ReductionPlan, default_reducers
from ti_schema import histogram_schema, history_schema

PLAN = ReductionPlan(default_reducers())


def _run() -> RunColumns:
    return RunColumns(
        history_schema("ti-core test"),
        histogram_schema("ti-core test"),
        "run1",
        0,
        tuple(f"layers.{i}" for i in range(6)),
        ("Linear",) * 6,
        PLAN.metric_names,
    )


FIELDS = ("layer", "call_index", "path", "train", "grad_enabled", "shape", "dtype", "timestamp_us")

Add = tuple[int, int, str, bool, bool]
"""``(tensor index, layer, path, train, grad_enabled)``: one ``TensorBatch.add`` (call index
counted per layer)."""


def _columns(entries: Entries) -> dict[str, list[object]]:
    return {name: list(getattr(entries, name)) for name in FIELDS}


def _forward(
    memo: StructureMemo | None,
    tensors: list[torch.Tensor],
    adds: list[tuple[int, int, str, bool, bool]],
    stamp: int,
    focus: frozenset[int] = frozenset(),
) -> TensorBatch:
    batch = TensorBatch(PLAN, focus, memo=memo)
    calls: dict[int, int] = {}
    for k, (t, layer, path, train, grad) in enumerate(adds):
        call = calls.get(layer, 0)
        calls[layer] = call + 1
        batch.add(tensors[t], layer, call, path, train, grad, stamp + k)
    return batch


def _expected(
    tensors: list[torch.Tensor], adds: list[tuple[int, int, str, bool, bool]], stamp: int
) -> dict[str, list[object]]:
    out: dict[str, list[object]] = {name: [] for name in FIELDS}
    calls: dict[int, int] = {}
    for k, (t, layer, path, train, grad) in enumerate(adds):
        call = calls.get(layer, 0)
        calls[layer] = call + 1
        row = (layer, call, path, train, grad, tuple(tensors[t].shape))
        for name, value in zip(FIELDS, (*row, str(tensors[t].dtype)[6:], stamp + k), strict=True):
            out[name].append(value)
    return out


BASE = [
    (0, 0, "", True, True),
    (0, 1, "", True, True),
    (1, 2, "[0]", True, True),
    (1, 2, "[1]", True, False),
]


def _tensors(
    shape: tuple[int, ...] = (2, 3), dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    return [torch.randn(shape).to(dtype), torch.randn(4)]


def test_equal_batches_share_one_structure_and_keep_their_own_times() -> None:
    memo = StructureMemo()
    first = _forward(memo, _tensors(), BASE, 1_000).finish()
    tensors = _tensors()
    second = _forward(memo, tensors, BASE, 5_000).finish()
    alone = _forward(None, _tensors(), BASE, 5_000).finish()
    assert first.entries.key is not None
    assert second.entries.key == first.entries.key != alone.entries.key
    assert _columns(first.entries) == _expected(tensors, BASE, 1_000)
    assert _columns(second.entries) == _columns(alone.entries) == _expected(tensors, BASE, 5_000)
    # the values are the second batch's own tensors', row for row
    own = np.asarray(PLAN.reduce(tensors).values, dtype=np.float64).reshape(2, -1)
    np.testing.assert_array_equal(second.values, own[[t for t, *_ in BASE]])


CHANGES: dict[str, Callable[[], tuple[list[torch.Tensor], list[Add]]]] = {
    "layer": lambda: (_tensors(), [BASE[0], (0, 5, "", True, True), *BASE[2:]]),
    "call index": lambda: (_tensors(), [BASE[0], (0, 0, "", True, True), *BASE[2:]]),
    "path": lambda: (_tensors(), [*BASE[:3], (1, 2, "[9]", True, False)]),
    "mode": lambda: (_tensors(), [(0, 0, "", False, True), *BASE[1:]]),
    "grad enabled": lambda: (_tensors(), [*BASE[:3], (1, 2, "[1]", True, True)]),
    "shape": lambda: (_tensors((3, 2)), BASE),
    "dtype": lambda: (_tensors(dtype=torch.float64), BASE),
    "slot": lambda: (_tensors(), [BASE[0], (1, 1, "", True, True), *BASE[2:]]),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_any_identity_change_gets_its_own_structure(change: str) -> None:
    memo = StructureMemo()
    _forward(memo, _tensors(), BASE, 1_000).finish()
    base = _forward(memo, _tensors(), BASE, 1_000).finish()
    tensors, adds = CHANGES[change]()
    changed = _forward(memo, tensors, adds, 2_000).finish()
    assert changed.entries.key != base.entries.key
    assert _columns(changed.entries) == _expected(tensors, adds, 2_000)
    again = _forward(memo, _tensors(), BASE, 3_000).finish()
    assert _columns(again.entries) == _expected(_tensors(), BASE, 3_000)


def test_a_same_sized_batch_with_other_rows_is_not_taken_for_the_remembered_one() -> None:
    # same length, same first row and as many slots: only the full comparison tells them apart
    other = [*BASE[:3], (1, 3, "[1]", True, False)]
    memo = StructureMemo()
    for k in range(3):
        for adds in (BASE, other):
            got = _forward(memo, _tensors(), adds, 100 * k).finish()
            assert _columns(got.entries) == _expected(_tensors(), adds, 100 * k)


def _derived(
    memo: StructureMemo, source: TensorBatch, picks: list[list[int]], stamp: int
) -> Entries:
    batch = TensorBatch(PLAN, frozenset(), memo=memo)
    for k, rows in enumerate(picks):
        batch.add_derived(
            torch.randn(source._slot_shape[source.rows[rows[0]][5]]), source.rows, rows, stamp + k
        )
    return batch.finish().entries


def test_derived_batches_share_a_structure_only_for_equal_picks_and_sources() -> None:
    memo = StructureMemo()
    tensors = _tensors()
    forward = _forward(memo, tensors, BASE, 0)
    picks = [[2, 3], [0, 1]]
    first = _derived(memo, forward, picks, 10)
    second = _derived(memo, forward, picks, 50)
    assert first.key == second.key is not None
    expected = _expected(tensors, BASE, 0)
    order = [2, 3, 0, 1]
    for name in FIELDS[:-1]:
        assert list(getattr(second, name)) == [expected[name][i] for i in order]
    assert second.timestamp_us == [50, 50, 51, 51]
    fewer = _derived(memo, forward, [[2, 3], [0]], 60)
    assert fewer.key != first.key
    assert fewer.layer == [2, 2, 0]
    moved = _forward(memo, tensors, [*BASE[:2], (1, 2, "[7]", True, True), BASE[3]], 0)
    elsewhere = _derived(memo, moved, picks, 70)
    assert elsewhere.key != first.key
    assert elsewhere.path == ["[7]", "[1]", "", ""]


def test_histogram_entries_follow_the_slots_that_have_a_histogram() -> None:
    memo = StructureMemo()
    focus = frozenset({0, 2})
    reduced = [_forward(memo, _tensors(), BASE, 10 * k, focus).finish() for k in range(2)]
    for k, got in enumerate(reduced):
        assert got.histogram_entries.layer == [0, 2, 2]
        assert got.histogram_entries.path == ["", "[0]", "[1]"]
        assert got.histogram_entries.timestamp_us == [10 * k, 10 * k + 2, 10 * k + 3]
        assert len(got.histograms) == 3
    assert reduced[0].histogram_entries.key == reduced[1].histogram_entries.key is not None
    # the rows of one slot's histogram are its own
    hist = reduced[1].histograms.rows
    np.testing.assert_array_equal(hist[1], hist[2])
    assert not np.array_equal(hist[0], hist[1])


def test_a_structure_recomputes_histogram_rows_for_other_slots_or_focus() -> None:
    forward = _forward(None, _tensors(), BASE, 0)
    structure = EntryStructure.of_rows(forward.rows, forward._slot_shape, forward._slot_dtype)
    rows, picked = structure.histogram_rows(frozenset({0, 1}), frozenset({0, 2}))
    assert rows == [0, 2, 3]
    assert picked is not None
    assert picked.slot_of == [0, 1, 1]
    rows, picked = structure.histogram_rows(frozenset({1}), frozenset({0, 2}))
    assert rows == [2, 3]
    assert picked is not None
    assert picked.columns[2] == ["[0]", "[1]"]
    rows, picked = structure.histogram_rows(frozenset({1}), frozenset({1}))
    assert rows == []
    assert picked is None
    rows, picked = structure.histogram_rows(frozenset({0}), frozenset({1}))
    assert rows == [1]
    assert picked is not None
    assert picked.columns[0] == [1]


def test_record_batches_reuse_identity_columns_by_key(monkeypatch: pytest.MonkeyPatch) -> None:
    memo = StructureMemo()
    run = _run()
    built = [_forward(memo, _tensors(), BASE, 10**15 * (k + 1)).finish() for k in range(2)]
    keyed = [
        history_batch(run, "output", k, k, r.entries, r.values, r.available, r.reasons)
        for k, r in enumerate(built)
    ]
    plain = []
    for k, r in enumerate(built):
        e = r.entries
        unkeyed = Entries.of_columns(*(list(getattr(e, n)) for n in FIELDS))
        plain.append(
            history_batch(_run(), "output", k, k, unkeyed, r.values, r.available, r.reasons)
        )
    assert [b.to_pylist() for b in keyed] == [b.to_pylist() for b in plain]
    # a known key is not compared by content again
    calls = []
    original = RunColumns._content_key
    monkeypatch.setattr(
        RunColumns, "_content_key", staticmethod(lambda *a: calls.append(1) or original(*a))
    )
    r = _forward(memo, _tensors(), BASE, 7).finish()
    history_batch(run, "output", 3, 3, r.entries, r.values, r.available, r.reasons)
    assert calls == []


class _Switching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if x.shape[0] > 2:  # a wide batch calls ``a`` a second time
            x = self.a(x)
        return self.b(x).relu()


def test_training_with_changing_structure_writes_each_samples_own_identity() -> None:
    model = _Switching()
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    plan = [(2, True), (2, True), (4, True), (2, False), (4, False), (2, True)]
    for rows, train in plan:
        model.train(train)
        model(torch.randn(rows, 6, requires_grad=True)).sum().backward()
    remove_observer(model)
    table = sink.table()
    for sample, (rows, train) in enumerate(plan):
        for signal in ("output", "output_gradient"):
            got = [
                r
                for r in table.to_pylist()
                if r["sample_id"] == sample and r["signal"] == signal and r["metric"] == "mean"
            ]
            calls = sorted((r["layer"], r["call_index"]) for r in got)
            a_calls = [("a", 0), ("a", 1)] if rows > 2 else [("a", 0)]
            assert calls == sorted([*a_calls, ("b", 0)]), (sample, signal)
            assert {r["mode"] for r in got} == {"train" if train else "eval"}
            assert {tuple(r["shape"]) for r in got} == {(rows, 6)}
